"""Llamas of real sizes for the GPU benchmarks, built at run time from the embedded arithmetic tokenizer (random
weights: nothing to download, nothing to carry to a machine without network).

    python benchmarks/llama_shapes.py 155m OUT_DIR

- ``155m``: 12 layers, hidden 1024, intermediate 2816, 16 heads (155M parameters with the embedded tokenizer's 319
  tokens): the shape TRL's GRPOTrainer was measured at on the H200 (../shared/docs/PLATFORM.md).
- ``1b``: TinyLlama-1.1B's shape (22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads; 0.97B parameters
  with this tokenizer).

A random model rarely samples EOS, so its responses run to the rollout's length: a fixed amount of work per step.
"""

from __future__ import annotations

import sys
from pathlib import Path

SHAPES = {
    "155m": dict(num_hidden_layers=12, hidden_size=1024, intermediate_size=2816, num_attention_heads=16),
    "1b": dict(
        num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4
    ),
}


def build(shape: str, out: Path, seed: int = 0) -> Path:
    """The ``shape`` Llama with the embedded arithmetic tokenizer, saved to ``out`` (kept if already there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlprof_train.models import load_tokenizer
    from rlprof_train.prepare import EMBEDDED_MODEL_DIR
    from rlprof_train.tiny_model import ensure_tiny_model

    if (out / "config.json").exists():
        return out
    tokenizer = load_tokenizer(ensure_tiny_model(EMBEDDED_MODEL_DIR, 4, "arithmetic"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def parameters(folder: Path) -> int:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    path = build(sys.argv[1], Path(sys.argv[2]))
    print(f"{path}: {parameters(path) / 1e6:.0f}M parameters")
