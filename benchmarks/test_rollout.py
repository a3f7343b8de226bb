"""Rollout speed: vLLM (vllm-cpu here) against Hugging Face ``generate`` on the same model, prompts and sampling,
measured in one run. Both produce exactly 64 prompts x 8 samples x 32 tokens (EOS ignored), so tokens/s compare
like for like; best of 3 after a warm-up."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, TOKENS = 64, 8, 32


def best_seconds(run) -> float:
    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.long  # information, no target (docs/trainer.md: no speed-up claimed yet): out of the test command
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_vs_hf_generate_tokens_per_second(benchmark, tmp_path):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlprof_train.data import arithmetic_rows, left_pad
    from rlprof_train.models import load_causal_lm, load_tokenizer
    from rlprof_train.tiny_model import create_tiny_model

    model_dir = create_tiny_model(tmp_path / "model", sft_steps=20)
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in arithmetic_rows(PROMPTS, 4, 0)]
    model = load_causal_lm(model_dir).eval()
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)

    def hf():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                num_return_sequences=SAMPLES,
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        assert out.shape == (PROMPTS * SAMPLES, ids.shape[1] + TOKENS)

    llm = LLM(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64, seed=0, disable_log_stats=True
    )
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]

    def vllm():
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == PROMPTS * SAMPLES * TOKENS

    tokens = PROMPTS * SAMPLES * TOKENS
    try:
        hf_seconds = best_seconds(hf)
        vllm_seconds = benchmark.pedantic(lambda: best_seconds(vllm), rounds=1, iterations=1)
    finally:
        llm.llm_engine.engine_core.shutdown()  # its engine process: stopped here, not by the interpreter's exit
    ratio = hf_seconds / vllm_seconds
    benchmark.extra_info.update(
        hf_tokens_per_s=tokens / hf_seconds, vllm_tokens_per_s=tokens / vllm_seconds, vllm_over_hf=ratio
    )
    print(
        f"\nrollout: HF generate {tokens / hf_seconds:.0f} tokens/s, vLLM {tokens / vllm_seconds:.0f} tokens/s "
        f"-> vLLM/HF = {ratio:.2f}x ({PROMPTS} prompts x {SAMPLES} samples x {TOKENS} tokens)"
    )
