"""Each diagnosis rule fires on a real run built to trigger it and stays silent on the runs built for the others;
the demo's run is reported end to end. Runs of the real trainer on a randomly initialised tiny model (its responses
run to the length limit, so generation time follows ``data.max_response_length``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlprof.analysis.report import build_report
from rlprof.analysis.report_model import ReportOptions
from rlprof.analysis.run import find_run

from conftest import ROOT, free_port, subprocess_env

pytestmark = pytest.mark.slow

RULES = ("rollout-bound", "training-bound", "memory-bound", "straggler-bound", "overhead-bound")
COMMON = (
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "data.max_prompt_length=16",
    "trainer.total_training_steps=8",
    'trainer.logger=["file"]',
)
BALANCED = (
    "data.max_response_length=12",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
)
"""Generation and training take about half of the step each (neither rule fires)."""
MEMORY = (
    "data.max_response_length=64",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    # the reference's pass and the update, the update's own log-probs reused: neither group dominates (generation
    # 57-62% of the step with the update alone, and rollout-bound fired in CI)
    "actor_rollout_ref.actor.reuse_on_policy_log_probs=true",
    "global_profiler.tool=torch_memory",
    "global_profiler.steps=[4]",
    "global_profiler.global_tool_config.torch_memory.host_allocations=false",  # RSS per range: the rule's evidence
)


def train(folder: Path, model: Path, *overrides: str, prefix: tuple[str, ...] = (sys.executable, "-m")) -> Path:
    command = [
        *prefix,
        "rlprof_train.main_ppo",
        "--config-name=demo",
        f"actor_rollout_ref.model.path={model}",
        *COMMON,
        f"trainer.log_dir={folder}/logs",
        f"trainer.default_local_dir={folder}/ckpt",
        f"global_profiler.save_path={folder}/profile",
        *overrides,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("random") / "model"
    subprocess.run(
        [sys.executable, "-m", "rlprof_train.tiny_model", "--out", str(out), "--sft-steps", "0"],
        check=True,
        capture_output=True,
        env=subprocess_env(),
        cwd=ROOT,
    )
    return out


@pytest.fixture(scope="module")
def runs(random_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    slow_rank_reward = root / "slow_rank_reward.py"
    slow_rank_reward.write_text(
        textwrap.dedent("""
        import os, time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if os.environ.get("RANK") == "1":
                time.sleep(0.02)  # rank 1 grades slowly
            return 0.0
    """)
    )
    torchrun = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
    )
    return {
        "rollout-bound": train(  # long responses of a random model, few of them: generation ~73% of the step
            root / "rollout",
            random_model,
            "data.max_response_length=96",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
        ),
        "training-bound": train(
            root / "training", random_model, *BALANCED, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"
        ),
        "memory-small": train(
            root / "memory_small", random_model, *MEMORY, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"
        ),
        # twice the responses, all in one micro-batch: host peaks 1.37x the small budget's here (0.76 GiB against 0.55)
        # (with the same 4 responses per prompt it reached 0.70-0.73 GiB, once short of the 1.06x this test needs).
        # Generated 8 prompts at a time, as many responses per call as the small run: in one call of 128, generation
        # was 36% of the step and training-bound fired in CI (training 64%, 1.79x)
        "memory-bound": train(
            root / "memory_large",
            random_model,
            *MEMORY,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.micro_batch_size=8",
        ),
        # generation about half the step, training the other half with the wait for rank 1 (160 tokens: generation
        # 81%, and rollout-bound fired too; 64 tokens: 33-44%, and training-bound fired once at 67% training)
        "straggler-bound": train(
            root / "straggler",
            random_model,
            "data.max_response_length=96",
            "actor_rollout_ref.actor.reuse_on_policy_log_probs=true",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.use_kl_loss=false",
            f"custom_reward_function.path={slow_rank_reward}",
            prefix=torchrun,
        ),
        "overhead-bound": train(
            root / "overhead", random_model, *BALANCED, "trainer.test_freq=1", "trainer.save_freq=1", "data.val_size=64"
        ),
    }


def host_peak(folder: Path) -> float:
    report = build_report(find_run([folder]))
    assert report.memory is not None and report.memory.host_rss is not None
    return report.memory.host_rss.peak_rss / 2**30


def fired(folder: Path, limit_gb: float) -> tuple[set[str], set[str]]:
    """The rules that fired on the run, and the time-share rules whose thresholds its measured shares cross."""
    from rlprof.analysis.diagnose import RULES as ALL_RULES

    report = build_report(find_run([folder]), ReportOptions(memory_limit_gb=limit_gb))
    assert report.breakdown is not None
    split, work = report.breakdown.split, report.breakdown.work_split
    print(folder.name, {group: round(share, 3) for group, share in split.items()})  # the shares the rules compare
    limits = {rule.name: rule.thresholds for rule in ALL_RULES}

    def dominant(group: str, other: str, rule: str) -> bool:
        share = work.get(group, 0.0)
        return share >= limits[rule]["share"] and share >= limits[rule]["over"] * work.get(other, 0.0)

    crossed = {
        "rollout-bound": dominant("rollout", "training", "rollout-bound"),
        "training-bound": dominant("training", "rollout", "training-bound"),
        "overhead-bound": (report.breakdown.idle_share or 0.0) >= limits["overhead-bound"]["idle"]
        or split.get("unaccounted", 0.0) >= limits["overhead-bound"]["unaccounted"],
    }
    return {f.rule for f in report.findings}, {rule for rule, crosses in crossed.items() if crosses}


def test_each_rule_fires_on_its_run_and_on_another_only_where_its_measured_shares_cross_the_thresholds(runs):
    """Each run is built to make its rule's evidence dominate by a wide margin. The time-share rules (rollout-,
    training-, overhead-bound) judge what was measured: on a run built for another rule they fire exactly where that
    run's own shares cross their thresholds (a busy machine moves shares); the memory and straggler rules fire on no
    other run."""
    small, large = host_peak(runs["memory-small"]), host_peak(runs["memory-bound"])
    print(f"\nhost peaks: small token budget {small:.3f} GiB, large {large:.3f} GiB")
    limit = small / 0.85  # the small budget's peak sits at 85% of it; the large one must reach 90%
    results = {name: fired(folder, limit) for name, folder in runs.items()}
    print(json.dumps({name: sorted(rules) for name, (rules, _) in results.items()}, indent=1))
    for name, (rules, crossed) in results.items():
        if name in RULES:
            assert name in rules, (name, rules)
        assert rules - {name} == crossed - {name}, (name, rules, crossed)


def test_the_findings_carry_evidence_and_overrides_to_paste(runs, capsys):
    from rlprof.cli import main

    assert main(["report", str(runs["training-bound"]), "--format", "json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["evidence"]["training_share"] >= 0.6
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2" in finding["overrides"]
    assert main(["report", str(runs["straggler-bound"]), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 takes" in out and "reward" in out


def test_a_two_rank_run_shows_per_rank_times_and_the_straggler(runs, capsys):
    from rlprof.cli import main

    assert main(["report", str(runs["straggler-bound"]), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["breakdown"]["stragglers"]["reward"] >= 1.25
