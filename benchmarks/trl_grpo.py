"""Run TRL's GRPOTrainer on the prompts rlprof_train would train on, step for step; the peer in test_vs_trl.py.

    python benchmarks/trl_grpo.py SPEC.json OUT.json

SPEC (written by test_vs_trl.py): ``model`` (directory), ``rows`` (one list of prompts per training step, each
``{"prompt": text, "ids": token ids, "ground_truth": ..., "data_source": ...}``, in rlprof_train's step order),
``n`` (completions per prompt), ``micro_batch`` (completions per forward/backward), ``response_length``, ``lr``,
``beta``, ``seed``, ``threads`` and optionally ``reward`` ({"path", "name"}: a verl-style ``compute_score`` file),
``device`` (``cpu``, the default, or ``cuda``: TRL on the GPU, as ``use_cpu=False``) and ``settings`` (``GRPOConfig``
fields over the ones below: TRL's own speed settings, e.g. ``{"bf16": true}`` or ``{"cache_implementation":
"static"}``).

TRL is configured as the equivalent of rlprof_train's GRPO settings: ``loss_type="dapo"`` (token-mean over the
accumulated batch), ``beta`` with k3 KL and no bias correction, ``scale_rewards="group"``, one iteration, constant
learning rate, gradient clipping 1.0, fp32, no gradient checkpointing, no vLLM, and gradient accumulation so that one
optimizer step consumes all completions of a step's prompts (``shuffle_dataset=False``: the prompts come in the
order given). OUT gets, per step: the wall time from the end of the previous step (generation included), the mean
reward, and the prompt-id fingerprint TRL actually trained on (checked against SPEC's token ids).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def fingerprint(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def load_score(reward: dict[str, str] | None) -> Any:
    if reward is None:
        from rlprof_train.reward_functions import default_compute_score

        return default_compute_score
    spec = importlib.util.spec_from_file_location("bench_reward", reward["path"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, reward["name"])


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps = spec["rows"]
    prompts_per_step, n = len(steps[0]), spec["n"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    for rows in steps:  # TRL tokenises the text itself: it must get the ids rlprof_train trains on
        for row in rows:
            got = tokenizer(text=row["prompt"])["input_ids"]
            if got != row["ids"]:
                raise SystemExit(f"prompt {row['prompt']!r} tokenises to {got} in TRL, not {row['ids']}")
    dataset = Dataset.from_list(
        [
            {"prompt": r["prompt"], "ground_truth": r["ground_truth"], "data_source": r["data_source"]}
            for s in steps
            for r in s
        ]
    )
    score = load_score(spec.get("reward"))
    rewards: dict[int, list[float]] = {}
    seen: dict[int, list[str]] = {}

    def reward(
        prompts: list[str], completions: list[str], ground_truth: list[str], data_source: list[str], **kw: Any
    ) -> list[float]:
        step = kw["trainer_state"].global_step + 1
        values = [float(score(s, c, g)) for s, c, g in zip(data_source, completions, ground_truth, strict=True)]
        rewards.setdefault(step, []).extend(values)
        seen.setdefault(step, []).extend(prompts[::n])
        return values

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    micro = spec["micro_batch"]
    completions = prompts_per_step * n
    if completions % micro:
        raise SystemExit(f"micro_batch={micro} does not divide the {completions} completions of a step")
    config = GRPOConfig(
        **{
            **dict(
                output_dir=str(Path(out_path).parent / "trl-output"),
                use_cpu=spec.get("device", "cpu") == "cpu",
                seed=spec["seed"],
                max_steps=len(steps),
                per_device_train_batch_size=micro,
                gradient_accumulation_steps=completions // micro,
                num_generations=n,
                max_completion_length=spec["response_length"],
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                learning_rate=spec["lr"],
                lr_scheduler_type="constant",
                warmup_steps=0,
                weight_decay=0.0,
                max_grad_norm=1.0,
                beta=spec["beta"],
                use_bias_correction_kl=False,
                loss_type="dapo",
                scale_rewards="group",
                num_iterations=1,
                epsilon=0.2,
                shuffle_dataset=False,
                bf16=False,
                fp16=False,
                gradient_checkpointing=False,
                use_vllm=False,
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                dataloader_num_workers=0,
            ),
            **spec.get("settings", {}),
        }
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()

    expected = [fingerprint([r["ids"] for r in rows]) for rows in steps]
    trained = [fingerprint([tokenizer(text=p)["input_ids"] for p in seen.get(s + 1, [])]) for s in range(len(steps))]
    result = {
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "reward": [sum(rewards[s]) / len(rewards[s]) for s in sorted(rewards)],
        "prompts_match": trained == expected,
        "optimizer": f"{type(trainer.optimizer.optimizer).__name__}, fused={trainer.optimizer.defaults.get('fused')}",
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
