"""Models: the embedded tiny model, loading local Hugging Face models, the critic's value model, and the
log-prob / entropy pass the actor and the reference share.

The embedded model is built here, with no download: a byte-level BPE tokenizer trained with ``tokenizers`` on
the built-in task's text (digits split one per token) and a 2-layer Llama with head_dim 64 (what vLLM's CPU
attention needs). ``python -m rlprof_train.models tiny --out DIR`` writes it; with ``--sft-steps N`` it first
learns the task's *format* only: answers in the training data are random numbers of the right range, so the model
learns to reply with a number and stop, but not which number, leaving the arithmetic to RL.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rlprof_train import algos
from rlprof_train.batch import pack
from rlprof_train.data import arithmetic_rows

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_tokenizer(corpus: list[str], vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` (digits always one token each), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def build_tiny_llama(tokenizer: Any, hidden: int = 128, layers: int = 2, heads: int = 2, seed: int = 0) -> Any:
    """A randomly initialised Llama sized for CPU tests (head_dim 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def format_warm_start(model: Any, tokenizer: Any, max_operand: int, steps: int, seed: int, correct_share: float,
                      lr: float = 3e-3) -> float:
    """Supervised steps on ``"a+b=" -> "<number></s>"`` where the number is the sum for ``correct_share`` of the
    examples and a random number of the same range otherwise: a weak SFT model that has the format but not the
    arithmetic. Returns the last loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        prompts, targets = [], []
        for row in arithmetic_rows(64, max_operand, rng.randrange(1 << 30)):
            prompts.append(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
            correct = rng.random() < correct_share
            answer = row["reward_model"]["ground_truth"] if correct else str(rng.randint(0, 2 * max_operand))
            targets.append(tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        width = max(len(p) + len(t) for p, t in zip(prompts, targets))
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, (p, t) in enumerate(zip(prompts, targets)):
            seq = p + t
            ids[row, width - len(seq):] = torch.tensor(seq)
            labels[row, width - len(t):] = torch.tensor(t)
            mask[row, width - len(seq):] = 1
        loss = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def create_tiny_model(out: Path, task: str = "arithmetic", max_operand: int = 4, sft_steps: int = 300,
                      correct_share: float = 0.25, seed: int = 0) -> Path:
    """Write the embedded tiny model (tokenizer + Llama, format warm-started) to ``out`` and return it."""
    if task != "arithmetic":
        raise ValueError(f"task={task!r}: the embedded model is built for the arithmetic task")
    corpus = [f"{r['prompt']}{r['reward_model']['ground_truth']}" for r in arithmetic_rows(2000, 99, seed)]
    corpus += ["What is the answer? Let's think step by step. #### 42", "The quick brown fox jumps over the lazy dog."]
    tokenizer = build_tokenizer(corpus)
    model = build_tiny_llama(tokenizer, seed=seed)
    if sft_steps:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same model whatever the machine's thread count (float sums depend on it)
        try:
            format_warm_start(model, tokenizer, max_operand, sft_steps, seed, correct_share)
        finally:
            torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_tiny_model(cache_dir: Path, max_operand: int) -> Path:
    """The embedded model for ``max_operand``, built once into ``cache_dir`` (built aside, then moved in place)."""
    out = Path(cache_dir) / f"tiny-arithmetic-op{max_operand}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    create_tiny_model(tmp, max_operand=max_operand)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_causal_lm(path: str | Path, dtype: str = "float32", gradient_checkpointing: bool = False) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=TORCH_DTYPES[dtype])
    model.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class ValueModel(torch.nn.Module):
    """The critic: the causal LM's transformer body with a scalar head (initialised to 0) on every position."""

    def __init__(self, path: str | Path, dtype: str = "float32", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(str(path), dtype=TORCH_DTYPES[dtype]).train()
        if gradient_checkpointing:
            self.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.value_head = torch.nn.Linear(self.body.config.hidden_size, 1, dtype=TORCH_DTYPES[dtype])
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: torch.Tensor) -> torch.Tensor:
        """Values ``[B, L]``; with ``attention_mask=None`` and restarting ``position_ids``, rows packed in one."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def response_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                        packed: bool = False, forward: Any = None) -> torch.Tensor:
        """V of the state before each response token, ``[B, R]`` (0 on padding). ``forward``: the callable to run
        (the DeepSpeed engine wrapping this module), default this module."""
        forward = forward or self
        if packed:
            layout = pack(input_ids, attention_mask, response_length)
            values = forward(layout.ids, None, layout.positions)[0, layout.predicts]
            return layout.unpack(values, input_ids.shape[0], response_length)
        values = forward(input_ids, attention_mask, position_ids(attention_mask))
        return values[:, -response_length - 1 : -1] * attention_mask[:, -response_length:]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each sequence's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def response_log_probs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, temperature: float = 1.0,
    *, with_entropy: bool = False, chunked_entropy: bool = False, checkpoint_entropy: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs ``[B, R]`` of the last ``response_length`` tokens of ``input_ids`` under ``model`` at
    ``temperature`` (the rollout's, so they match the sampling distribution), and their entropies when asked.

    ``packed`` (``use_remove_padding``) runs the model on the real tokens only, all rows in one packed sequence,
    and computes the head only where a response token is predicted; the padded path runs on ``[B, P+R]``.
    ``chunked_entropy`` computes entropies a chunk of positions at a time; ``checkpoint_entropy`` recomputes the
    entropy's softmax in backward instead of keeping it. Padding positions are 0 in both outputs.
    """
    if packed:
        layout = pack(input_ids, attention_mask, response_length)
        logits = model(input_ids=layout.ids, position_ids=layout.positions, use_cache=False).logits[0]
        logits = logits[layout.predicts].float() / max(temperature, 1e-6)  # [N, V]
        targets = layout.ids[0, layout.predicts + 1]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids(attention_mask), use_cache=False).logits
        logits = logits[:, -response_length - 1 : -1].float() / max(temperature, 1e-6)  # [B, R, V]
        targets = input_ids[:, -response_length:]
    log_probs = torch.gather(F.log_softmax(logits, dim=-1), -1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy_fn = algos.entropy_from_logits_chunked if chunked_entropy else algos.entropy_from_logits
        if checkpoint_entropy and logits.requires_grad:
            from torch.utils.checkpoint import checkpoint

            entropy = checkpoint(entropy_fn, logits, use_reentrant=False)
        else:
            entropy = entropy_fn(logits)
    if packed:
        batch = input_ids.shape[0]
        log_probs = layout.unpack(log_probs, batch, response_length)
        entropy = layout.unpack(entropy, batch, response_length) if entropy is not None else None
    else:
        response_mask = attention_mask[:, -response_length:]
        log_probs = log_probs * response_mask
        entropy = entropy * response_mask if entropy is not None else None
    return log_probs, entropy


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlprof_train.models",
                                     description="Build the embedded tiny model (no downloads).")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny", help="tokenizer + 2-layer Llama, format warm-started on the arithmetic task")
    tiny.add_argument("--out", type=Path, required=True, help="output directory")
    tiny.add_argument("--max-operand", type=int, default=4, help="arithmetic operands 0..N (default 4)")
    tiny.add_argument("--sft-steps", type=int, default=300, help="warm-start steps (0: random weights)")
    tiny.add_argument("--correct-share", type=float, default=0.25,
                      help="share of warm-start examples answered correctly (the rest: random numbers)")
    tiny.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = create_tiny_model(args.out, max_operand=args.max_operand, sft_steps=args.sft_steps,
                            correct_share=args.correct_share, seed=args.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
