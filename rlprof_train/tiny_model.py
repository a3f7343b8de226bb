"""The embedded tiny models, built here with no download: a byte-level BPE tokenizer trained with ``tokenizers`` on
the built-in task's text (digits split one per token) and a small Llama with head_dim 64 (what vLLM's CPU attention
needs), warm-started on noisy demonstrations: the correct answer for 25% of examples, a random one of the right
form otherwise, i.e. a weak SFT model with the right format and a low reward, leaving the task to RL. The same bytes
whether the CPU's kernels are AVX2 or AVX-512 (:data:`REPRODUCIBLE_MATH`).

- ``arithmetic``: ``"a+b="`` -> the sum; 2 layers; reward ~0.1 after the warm start.
- ``reverse``: ``"Reverse the digits: 31415 ->"`` -> ``"51413"``; 4 layers; responses as long as the input.
- ``calculator``: ``"7*8="`` -> a hermes call of the ``calculator`` tool, its reply, then ``"56"``; 2 layers; the
  demonstrations call it with the right expression for 25% of examples, with other operands or not at all otherwise.

    python -m rlprof_train.tiny_model --out DIR [--task arithmetic|reverse] [--max-operand 4] [--sft-steps N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from rlprof_train.agent.builtin import evaluate
from rlprof_train.agent.parser import hermes_call
from rlprof_train.data import BUILTIN_TASKS, arithmetic_rows, calculator_rows, reverse_rows
from rlprof_train.models import position_ids

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_tokenizer(corpus: list[str], vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` (digits always one token each), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def build_tiny_llama(tokenizer: Any, hidden: int = 128, layers: int = 2, heads: int = 2, seed: int = 0) -> Any:
    """A randomly initialised Llama sized for CPU tests (head_dim 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _wrong_answer(task: str, truth: str, max_operand: int, rng: random.Random) -> str:
    """A wrong-or-lucky answer of the task's form: a number of the sums' range, or as many random digits."""
    if task == "arithmetic":
        return str(rng.randint(0, 2 * max_operand))
    if task == "calculator":
        return str(rng.randint(0, max_operand) * rng.randint(0, max_operand))
    return "".join(rng.choice("0123456789") for _ in truth)


def calculator_call(expression: str) -> str:
    """The calculator task's call, as the demonstrations write it."""
    return hermes_call("calculator", {"expression": expression})


def _demonstration(
    task: str, example: dict[str, Any], correct: bool, tokenizer: Any, max_operand: int, rng: random.Random
) -> list[tuple[list[int], bool]]:
    """One demonstration as ``(token ids, trained)`` segments: the prompt (not trained), then the response. A
    calculator demonstration calls the tool with the prompt's expression when ``correct``, else with other operands
    or not at all (half each); the tool's reply (not trained) is the one a multi-turn rollout appends."""
    from rlprof_train.workers.rollout.multi_turn import ToolReplies

    eos = [tokenizer.eos_token_id]
    prompt = example["prompt"]
    segments = [(tokenizer(prompt, add_special_tokens=False)["input_ids"], False)]
    truth = example["reward_model"]["ground_truth"]
    if task == "calculator" and (correct or rng.random() < 0.5):
        expression = prompt.rstrip("=") if correct else f"{rng.randint(0, max_operand)}*{rng.randint(0, max_operand)}"
        value = str(evaluate(expression))
        return [
            *segments,
            (tokenizer(calculator_call(expression), add_special_tokens=False)["input_ids"] + eos, True),
            (ToolReplies(tokenizer).tokens([value]), False),
            (tokenizer(value, add_special_tokens=False)["input_ids"] + eos, True),
        ]
    answer = truth if correct else _wrong_answer(task, truth, max_operand, rng)
    return [*segments, (tokenizer(answer, add_special_tokens=False)["input_ids"] + eos, True)]


def format_warm_start(
    model: Any,
    tokenizer: Any,
    max_operand: int,
    steps: int,
    seed: int,
    correct_share: float,
    lr: float = 3e-3,
    task: str = "arithmetic",
) -> float:
    """Supervised steps on the task's prompts -> its demonstrations (:func:`_demonstration`), correct for
    ``correct_share`` of the examples and of the right form otherwise: a weak SFT model that has the format but not
    the task. Returns the last loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        demonstrations = [
            _demonstration(task, example, rng.random() < correct_share, tokenizer, max_operand, rng)
            for example in BUILTIN_TASKS[task](64, max_operand, rng.randrange(1 << 30))
        ]
        width = max(sum(len(ids) for ids, _ in segments) for segments in demonstrations)
        ids = torch.full((len(demonstrations), width), tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for row, segments in enumerate(demonstrations):
            column = width - sum(len(segment) for segment, _ in segments)
            mask[row, column:] = 1
            for segment, trained in segments:
                ids[row, column : column + len(segment)] = torch.tensor(segment)
                if trained:
                    labels[row, column : column + len(segment)] = torch.tensor(segment)
                column += len(segment)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


LAYERS = {"arithmetic": 2, "reverse": 4, "calculator": 2}
SFT_STEPS = {
    "arithmetic": 300,
    "reverse": 150,
    "calculator": 300,
}  # warm-start steps by default (the reverse model's are longer)


def task_corpus(task: str, seed: int) -> list[str]:
    """The text the task's tokenizer is trained on."""
    if task == "arithmetic":
        rows = arithmetic_rows(2000, 99, seed)
    elif task == "calculator":
        rows = calculator_rows(2000, 99, seed)
    else:
        rows = reverse_rows(2000, 20, seed)
    corpus = [f"{r['prompt']}{r['reward_model']['ground_truth']}" for r in rows]
    if task == "calculator":
        corpus += [
            f"{calculator_call(r['prompt'].rstrip('='))}\n<tool_response>\n{r['reward_model']['ground_truth']}\n"
            "</tool_response>\n"
            for r in rows
        ]
    return [
        *corpus,
        "What is the answer? Let's think step by step. #### 42",
        "The quick brown fox jumps over the lazy dog.",
    ]


# Kernels that sum in the same order whatever vector units an x86-64 CPU has: ATen's scalar kernels, MKL's
# conditional numerical reproducibility, oneDNN's SSE4.1 code, one thread. With each CPU's own kernels (AVX2, AVX-512,
# AMX), float sums are ordered differently and the warm start amplifies the last bits into another model: the demo's
# reward after 300 GRPO steps was 0.62 with the model built by AVX-512 kernels and 0.92 with the one built by AVX2
# kernels, on one machine.
REPRODUCIBLE_MATH = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def build_environment() -> dict[str, str]:
    """The environment of a build: this one with the reproducible math and without the distributed job's variables
    (inside a distributed job, transformers' ``save_pretrained`` writes only on global rank 0)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    return {**env, **REPRODUCIBLE_MATH}


def create_tiny_model(
    out: Path,
    task: str = "arithmetic",
    max_operand: int = 4,
    sft_steps: Optional[int] = None,
    correct_share: float = 0.25,
    seed: int = 0,
) -> Path:
    """Write the embedded tiny model of ``task`` (tokenizer + Llama, format warm-started) to ``out`` and return it:
    the same bytes whether the CPU's kernels are AVX2 or AVX-512, built in a process of its own with
    :data:`REPRODUCIBLE_MATH`."""
    if task not in LAYERS:
        raise ValueError(f"task={task!r}: the embedded models are built for the tasks {', '.join(LAYERS)}")
    command = [sys.executable, "-m", "rlprof_train.tiny_model", "--out", str(out), "--task", task]
    command += ["--max-operand", str(max_operand), "--correct-share", str(correct_share), "--seed", str(seed)]
    if sft_steps is not None:
        command += ["--sft-steps", str(sft_steps)]
    built = subprocess.run(command, capture_output=True, text=True, env=build_environment(), check=False)
    if built.returncode != 0:
        raise RuntimeError(f"building the embedded model failed:\n{built.stderr[-3000:]}")
    return out


def _build(out: Path, task: str, max_operand: int, sft_steps: Optional[int], correct_share: float, seed: int) -> None:
    """The build itself, in the process :func:`create_tiny_model` starts."""
    sft_steps = SFT_STEPS[task] if sft_steps is None else sft_steps
    tokenizer = build_tokenizer(task_corpus(task, seed))
    model = build_tiny_llama(tokenizer, layers=LAYERS[task], seed=seed)
    if sft_steps:
        format_warm_start(model, tokenizer, max_operand, sft_steps, seed, correct_share, task=task)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


BUILD_VERSION = 2  # raised when a build makes other bytes (2: REPRODUCIBLE_MATH), so no cache keeps an older model


def embedded_model_name(task: str, max_operand: int) -> str:
    """The embedded model's folder name under the model cache."""
    return f"tiny-{task}-op{max_operand}-v{BUILD_VERSION}"


def ensure_tiny_model(cache_dir: Path, max_operand: int, task: str = "arithmetic") -> Path:
    """The embedded model for ``task`` and ``max_operand``, built once into ``cache_dir`` (built aside, then moved in
    place)."""
    out = Path(cache_dir) / embedded_model_name(task, max_operand)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        create_tiny_model(tmp, task=task, max_operand=max_operand)
    except RuntimeError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    tiny = argparse.ArgumentParser(
        prog="python -m rlprof_train.tiny_model",
        description="Build an embedded tiny model (tokenizer + small Llama, warm-started on a built-in task; "
        "no downloads).",
    )
    tiny.add_argument("--task", choices=sorted(LAYERS), default="arithmetic", help="built-in task (default arithmetic)")
    tiny.add_argument("--out", type=Path, required=True, help="output directory")
    tiny.add_argument(
        "--max-operand", type=int, default=4, help="arithmetic: operands 0..N; reverse: 1..N digits (default 4)"
    )
    tiny.add_argument(
        "--sft-steps", type=int, default=None, help="warm-start steps (0: random weights; default 300, reverse 150)"
    )
    tiny.add_argument(
        "--correct-share",
        type=float,
        default=0.25,
        help="share of warm-start examples answered correctly (the rest: random numbers)",
    )
    tiny.add_argument("--seed", type=int, default=0)
    args = tiny.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in REPRODUCIBLE_MATH.items()):  # by hand: the same bytes as the trainer's
        create_tiny_model(args.out, args.task, args.max_operand, args.sft_steps, args.correct_share, args.seed)
    else:
        _build(args.out, args.task, args.max_operand, args.sft_steps, args.correct_share, args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
