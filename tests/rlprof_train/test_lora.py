"""LoRA with PEFT (verl's ``actor_rollout_ref.model.lora_rank``): only the adapters train, the reference is the base
model with adapters disabled, a weight sync hands the merged weights on, checkpoints hold the adapters and resume
to the same steps, and it learns the demo task (its memory and step time against full fine-tuning:
benchmarks/test_lora.py)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from rlprof.tracking.jsonl import read_jsonl
from rlprof_train.config.load import load_trainer_config

from conftest import ROOT, subprocess_env, trainer_command

LORA = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from rlprof_train.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", sft_steps=0)


def lora_model(base_dir):
    from rlprof_train.models import load_causal_lm

    model_cfg = load_trainer_config([*LORA]).actor_rollout_ref.model
    return load_causal_lm(base_dir, lora=model_cfg)


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_only_adapters_train_and_disabling_them_gives_the_base_model(base_dir):
    from transformers import AutoModelForCausalLM

    from rlprof_train.models import trainable_parameters

    model = lora_model(base_dir)
    trained, total = trainable_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert trained < total / 10
    with torch.no_grad():  # move the adapters off their zero start, so disabling them has something to undo
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.1)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            disabled = model(input_ids=ids).logits
        reference = base(input_ids=ids).logits
    assert torch.allclose(disabled, reference, atol=1e-6)
    assert not torch.allclose(adapted, reference, atol=1e-3)


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_merged_weights_are_peft_merge_and_unload(base_dir):
    """What vLLM is given after an update: the base model's names, ``W + B A * alpha / r``, equal to PEFT's own
    ``merge_and_unload`` of a copy; the adapters stay unmerged in the trained model."""
    import copy

    from rlprof_train.models import merged_state_dict

    model = lora_model(base_dir)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = merged_state_dict(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    assert all(torch.allclose(merged[k], expected[k], atol=1e-6) for k in expected)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # unmerged again


def run(tmp_path, *overrides) -> subprocess.CompletedProcess:
    """The trainer in a fresh process."""
    result = subprocess.run(
        trainer_command(tmp_path, *overrides),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def scores(folder) -> list[float]:
    return [r["critic/score/mean"] for r in read_jsonl(folder / "logs" / "metrics.jsonl") if r["step"] > 0]


EVERY_LINEAR = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"


@pytest.mark.long  # 300 steps (2-6 minutes on 2 cores): left out of scripts/test.sh, run with -m long
def test_lora_learns_the_arithmetic_task(tmp_path):
    """docs/performance_tuning.md's LoRA run: the demo's GRPO with rank-8 adapters on every linear layer, the output
    layer included (PEFT's all-linear leaves it out), lr 2e-3: from about 0.10 to at least 0.5 over the last 50 of 300
    steps. Seed 1 reached 0.71 here alone, 0.66 here beside another test and 0.59 in CI (the embedded model is the same
    bytes everywhere, see rlprof_train.tiny_model.REPRODUCIBLE_MATH; training's kernels are the machine's own), so
    the bound is the one the docs state, and a run that misses is tried once more with the next seed."""
    windows: list[list[float]] = []
    for seed in (1, 2):
        folder = tmp_path / f"seed{seed}"
        result = run(
            folder,
            *LORA,
            f"actor_rollout_ref.model.target_modules={EVERY_LINEAR}",
            "actor_rollout_ref.actor.optim.lr=2e-3",
            "trainer.test_freq=-1",
            f"trainer.seed={seed}",
        )
        assert "model: LoRA rank 8 (alpha 16.0) on ['q_proj'" in result.stderr
        curve = scores(folder)
        start, plateau = sum(curve[:5]) / 5, sum(curve[-50:]) / 50
        windows.append([round(sum(curve[i : i + 25]) / 25, 2) for i in range(0, len(curve), 25)])
        print(f"\nLoRA GRPO, seed {seed}: steps 1-5 {start:.3f}, last 50 steps {plateau:.3f}, per 25 {windows[-1]}")
        if start <= 0.3 and plateau >= 0.5:
            break
    assert start <= 0.3 and plateau >= 0.5, windows


@pytest.mark.long  # about a minute on 2 cores: kept out of the test command for its time (CI under 45 minutes)
def test_lora_checkpoint_holds_the_adapters_and_resumes_to_the_same_steps(tmp_path):
    import shutil

    steps = (*LORA, "trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=-1")
    reference = tmp_path / "reference"
    run(reference, *steps)
    states = torch.load(
        next((reference / "ckpt" / "global_step_3" / "actor").rglob("mp_rank_00_model_states.pt")), weights_only=False
    )["module"]
    assert states and all(".lora_" in name for name in states), sorted(states)[:5]  # the adapters only
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(reference / "ckpt" / "global_step_3", resumed / "ckpt" / "global_step_3")
    (resumed / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    run(resumed, *steps, "trainer.resume_mode=auto")
    keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "training/batch_fingerprint")
    original = {r["step"]: r for r in read_jsonl(reference / "logs" / "metrics.jsonl")}
    after = {r["step"]: r for r in read_jsonl(resumed / "logs" / "metrics.jsonl")}
    assert sorted(after) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in keys:
            assert after[step][key] == pytest.approx(original[step][key], abs=1e-6), (step, key)
