"""Timers and metric builders: marked_timer, timing/throughput/data/memory metrics, the explicit-reducer
aggregator, cross-rank timing over two real processes, and MFU from hand-derived FLOP counts."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest
import torch

import rlprof
from rlprof.metrics import (
    MetricAggregator,
    Reduce,
    compute_data_metrics,
    compute_memory_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    estimate_flops,
    mfu_metrics,
    peak_flops,
    timing_shares,
    timing_spread,
)
from rlprof.metrics.flops import cpu_peak_flops, model_shape
from rlprof.timer import marked_timer

from conftest import free_port, subprocess_env


def test_marked_timer_accumulates_nests_and_records_a_range(tmp_path):
    rlprof.init({"global_profiler": {"tool": "torch", "steps": [1], "save_path": str(tmp_path)}})
    timing = {}
    with rlprof.step(1):
        with marked_timer("step", timing):
            with marked_timer("gen", timing, role="rollout"):
                time.sleep(0.02)
            with marked_timer("gen", timing, role="rollout"):
                time.sleep(0.02)
    rlprof.shutdown()
    assert 0.04 <= timing["gen"] < timing["step"]
    import gzip
    import json

    from rlprof.manifest import read_manifest

    with gzip.open(tmp_path / read_manifest(tmp_path)[0]["path"], "rt") as handle:
        names = [e["name"] for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    assert names.count("rollout/gen") == 2 and names.count("default/step") == 1


def test_marked_timer_records_the_time_of_a_raising_block_and_reraises_unchanged():
    timing = {}
    error = KeyError("missing batch")
    with pytest.raises(KeyError) as info:
        with marked_timer("update_actor", timing):
            time.sleep(0.01)
            raise error
    assert info.value is error
    assert timing["update_actor"] >= 0.01


def test_timing_metrics_per_token():
    metrics = compute_timing_metrics(
        {"gen": 2.0, "update_actor": 3.0, "step": 6.0}, num_prompt_tokens=600, num_response_tokens=400
    )
    assert metrics == {
        "timing_s/gen": 2.0,
        "timing_s/update_actor": 3.0,
        "timing_s/step": 6.0,
        "timing_per_token_ms/gen": 5.0,  # per response token: 2000 ms / 400
        "timing_per_token_ms/update_actor": 3.0,  # per token: 3000 ms / 1000
    }


def test_throughput_metrics():
    metrics = compute_throughput_metrics(
        step_seconds=4.0, total_num_tokens=8000, num_devices=2, num_samples=64, gen_seconds=2.0
    )
    assert metrics == {
        "perf/total_num_tokens": 8000.0,
        "perf/time_per_step": 4.0,
        "perf/throughput": 1000.0,
        "perf/rollout_samples_per_s": 32.0,
        "throughput/tokens_per_sec": 2000.0,
        "throughput/samples_per_sec": 16.0,
    }
    with pytest.raises(ValueError, match="num_devices=0"):
        compute_throughput_metrics(1.0, 10, 0)


def test_data_metrics():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    metrics = compute_data_metrics(
        token_level_scores=torch.tensor([[0.0, 0.0, 1.0], [0.5, 9.0, 9.0]]),
        token_level_rewards=torch.tensor([[-0.1, 0.0, 1.0], [0.4, 9.0, 9.0]]),
        advantages=torch.tensor([[1.0, 2.0, 3.0], [-4.0, 99.0, 99.0]]),
        returns=torch.tensor([[1.0, 1.0, 1.0], [2.0, 99.0, 99.0]]),
        values=torch.tensor([[0.5, 0.5, 0.5], [0.1, 99.0, 99.0]]),
        response_mask=mask,
        prompt_lengths=torch.tensor([4, 8]),
        max_response_length=3,
        max_prompt_length=8,
    )
    assert metrics["critic/score/mean"] == pytest.approx(0.75) and metrics["critic/score/min"] == 0.5
    assert metrics["critic/rewards/max"] == pytest.approx(0.9)
    assert metrics["critic/advantages/mean"] == pytest.approx(0.5) and metrics["critic/advantages/min"] == -4.0
    assert metrics["critic/returns/max"] == 2.0 and metrics["critic/values/min"] == pytest.approx(0.1)
    assert metrics["response_length/mean"] == 2.0 and metrics["response_length/clip_ratio"] == 0.5
    assert metrics["response_length/p99"] == pytest.approx(1 + 0.99 * (3 - 1))  # lengths 3 and 1, interpolated
    assert metrics["prompt_length/max"] == 8.0 and metrics["prompt_length/clip_ratio"] == 0.5


def test_memory_metrics_on_cpu():
    metrics = compute_memory_metrics()
    assert (
        metrics["perf/process_rss_gb"] > 0
        and 0 < metrics["perf/cpu_memory_used_gb"] < metrics["perf/cpu_memory_total_gb"]
    )
    assert ("perf/max_memory_allocated_gb" in metrics) == (torch.cuda.is_available() and torch.cuda.is_initialized())


def test_aggregator_uses_the_stated_reducer_per_metric():
    agg = MetricAggregator()
    for loss, tokens, clip, lr in ((1.0, 10, 0.1, 1e-3), (4.0, 30, 0.3, 2e-3)):
        agg.add("actor/pg_loss", loss, Reduce.WEIGHTED_MEAN, weight=tokens)
        agg.add("actor/pg_clipfrac", clip, Reduce.MEAN)
        agg.add("perf/tokens", tokens, Reduce.SUM)
        agg.add("actor/grad_norm", loss, Reduce.MAX)
        agg.add("actor/lr", lr, Reduce.LAST)
        agg.add("critic/vpred_min", -loss, Reduce.MIN)
    assert agg.compute() == pytest.approx(
        {
            "actor/pg_loss": 3.25,
            "actor/pg_clipfrac": 0.2,
            "perf/tokens": 40.0,
            "actor/grad_norm": 4.0,
            "actor/lr": 2e-3,
            "critic/vpred_min": -4.0,
        }
    )
    with pytest.raises(ValueError, match="actor/pg_loss: added with reduce=mean after reduce=weighted_mean"):
        agg.add("actor/pg_loss", 1.0, Reduce.MEAN)
    with pytest.raises(TypeError, match="must be a rlprof.metrics.Reduce"):
        agg.add("x", 1.0, "mean")


def test_timing_spread_pure():
    spread = timing_spread([{"gen": 1.0, "update_actor": 2.0}, {"gen": 3.0, "update_actor": 2.0}])
    assert spread["timing_ranks/gen/min"] == 1.0 and spread["timing_ranks/gen/max"] == 3.0
    assert spread["timing_ranks/gen/mean"] == 2.0 and spread["timing_ranks/gen/straggler"] == 1.5
    assert spread["timing_ranks/update_actor/straggler"] == 1.0
    assert spread["timing_ranks/gen/slowest_rank"] == 1.0


@pytest.mark.slow
def test_two_process_timing_reduction(tmp_path):
    script = tmp_path / "reduce.py"
    script.write_text(
        "import json, torch.distributed as dist\n"
        "from rlprof.metrics import reduce_timing_across_ranks\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "timing = {'gen': [1.0, 3.0][rank], 'update_actor': [2.0, 2.0][rank]}\n"
        "if rank == 1: timing['ref'] = 0.5\n"
        "out = reduce_timing_across_ranks(timing)\n"
        f"open(r'{tmp_path}/rank%d.json' % rank, 'w').write(json.dumps(out))\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            str(script),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=subprocess_env(),
    )
    import json

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0] == results[1]
    out = results[0]
    assert (out["timing_ranks/gen/min"], out["timing_ranks/gen/max"], out["timing_ranks/gen/mean"]) == (1.0, 3.0, 2.0)
    assert out["timing_ranks/gen/straggler"] == 1.5 and out["timing_ranks/update_actor/straggler"] == 1.0
    assert out["timing_ranks/ref/mean"] == 0.5  # timed on one rank only


LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "hidden_act": "silu",
}
QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "hidden_act": "silu",
}
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def hand_flops(h, layers, heads, kv, head_dim, inter_total_per_token_mlp, vocab, seqs):
    """Forward FLOPs written out term by term (multiply-add = 2)."""
    tokens = sum(seqs)
    per_layer_token = (
        2 * h * heads * head_dim  # q
        + 2 * 2 * h * kv * head_dim  # k, v
        + 2 * heads * head_dim * h  # o
        + inter_total_per_token_mlp
    )  # mlp (+ router)
    attention = sum(layers * 2 * heads * head_dim * s * (s + 1) for s in seqs)  # causal QK^T + AV, counted once
    return tokens * (layers * per_layer_token + 2 * h * vocab) + attention


def test_flops_llama_dense():
    seqs = [512, 1024]
    expected = hand_flops(4096, 32, 32, 32, 128, 3 * 2 * 4096 * 11008, 32000, seqs)
    estimate = estimate_flops(LLAMA, seqs)
    assert estimate.forward == expected and estimate.training == 3 * expected and estimate.tokens == 1536
    # sanity: ~2 FLOPs per parameter per token for short sequences (Llama-2-7B has 6.74e9 parameters)
    assert 2 * 6.5e9 < estimate_flops(LLAMA, [1]).forward < 2 * 6.8e9


def test_flops_qwen2_grouped_query_attention():
    seqs = [300]
    assert estimate_flops(QWEN2, seqs).forward == hand_flops(3584, 28, 28, 4, 128, 3 * 2 * 3584 * 18944, 152064, seqs)


def test_flops_mixtral_counts_router_and_top_k_experts():
    seqs = [256, 256, 100]
    mlp = 2 * 4096 * 8 + 2 * 3 * 2 * 4096 * 14336  # router over 8 experts + 2 active SwiGLU experts
    assert estimate_flops(MIXTRAL, seqs).forward == hand_flops(4096, 32, 32, 8, 128, mlp, 32000, seqs)


def test_flops_from_a_real_transformers_config():
    from transformers import LlamaConfig

    assert (
        estimate_flops(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}), [64]).forward
        == estimate_flops(LLAMA, [64]).forward
    )
    assert (
        model_shape(
            {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "activation_function": "gelu_new"}
        ).mlp_matrices
        == 2
    )  # GPT-2: plain 4h MLP


def test_mfu_with_known_device_and_override():
    flops = estimate_flops(LLAMA, [1000]).training
    metrics = mfu_metrics("actor", LLAMA, [1000], seconds=1.0, num_devices=2, device="NVIDIA H100 80GB HBM3")
    assert metrics["perf/mfu/actor"] == pytest.approx(flops / (2 * 989e12))
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12
    assert mfu_metrics("critic", LLAMA, [10], 1.0, peak_tflops=100.0, device="Mystery")["perf/mfu/critic"] > 0


def test_mfu_unknown_device_or_model_is_absent_with_one_warning(monkeypatch):
    monkeypatch.delenv("RLPROF_PEAK_TFLOPS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mfu_metrics("actor", LLAMA, [10], 1.0, device="Voodoo 5 6000") == {}
        assert mfu_metrics("actor", LLAMA, [10], 1.0, device="Voodoo 5 6000") == {}
        assert mfu_metrics("ref", {"hidden_size": 8}, [10], 1.0, device="NVIDIA A100") == {}
    messages = [str(w.message) for w in caught]
    assert len([m for m in messages if "Voodoo" in m]) == 1
    assert any("perf/mfu/ref is left out" in m and "num_attention_heads" in m for m in messages)


def test_an_mfu_above_1_is_warned_about_once_per_role_naming_the_peak_and_its_source(monkeypatch):
    monkeypatch.delenv("RLPROF_PEAK_TFLOPS", raising=False)
    flops = estimate_flops(LLAMA, [1000]).training
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seconds in (1.0, 0.5):  # a peak given 1000x too low: about 1000x the MFU
            value = mfu_metrics("reward", LLAMA, [1000], seconds, peak_tflops=flops / 1e12 / 1000)["perf/mfu/reward"]
            assert value == pytest.approx(1000 / seconds)
        assert mfu_metrics("reward", LLAMA, [1000], 1.0, peak_tflops=flops / 1e12 * 4)[
            "perf/mfu/reward"
        ] == pytest.approx(0.25)
        monkeypatch.setenv("RLPROF_PEAK_TFLOPS", str(flops / 1e12 / 10))
        mfu_metrics("values", LLAMA, [1000], 1.0, device="NVIDIA A100")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith("perf/mfu/reward=1000.00 is above 1") and "given as peak_tflops" in messages[0]
    assert messages[1].startswith("perf/mfu/values=10.00 is above 1") and "from $RLPROF_PEAK_TFLOPS" in messages[1]
    assert "RLPROF_PEAK_TFLOPS" in messages[0] and "num_devices=1" in messages[0]


def test_an_mfu_far_below_what_the_device_reaches_is_warned_about_naming_the_peak(monkeypatch):
    """A peak given in FLOP/s where TFLOP/s are meant (10^12 too high) makes every MFU tiny: warned once per role,
    with the matmul rate measured here. A slow pass against a peak within reach is not; nor is a device this process
    does not have (nothing to measure)."""
    from rlprof.metrics.flops import FAR_BELOW, matmul_flops

    monkeypatch.delenv("RLPROF_PEAK_TFLOPS", raising=False)
    rate = matmul_flops("cpu")
    peak = cpu_peak_flops()
    assert rate is not None and rate > 1e8 and (peak is None or rate < 1.5 * peak)  # the estimate bounds it
    assert matmul_flops("NVIDIA A100") is None  # not this process's device
    flops = estimate_flops(LLAMA, [1000]).training
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setenv("RLPROF_PEAK_TFLOPS", str(rate))  # FLOP/s given as TFLOP/s
        for _ in range(2):
            tiny = mfu_metrics("actor", LLAMA, [1000], flops / rate, device="cpu")["perf/mfu/actor"]
            assert tiny == pytest.approx(1e-12)
        monkeypatch.setenv("RLPROF_PEAK_TFLOPS", str(rate / 1e12))  # the right unit, a pass 200x slower than it
        slow = mfu_metrics("ref", LLAMA, [1000], 200 * flops / rate, device="cpu")["perf/mfu/ref"]
        assert slow == pytest.approx(1 / 200) and slow < 1 / FAR_BELOW
        monkeypatch.setenv("RLPROF_PEAK_TFLOPS", str(rate))
        mfu_metrics("values", LLAMA, [1000], flops / rate, device="NVIDIA A100")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith("perf/mfu/actor=1e-12 is far below what this device reaches: it ran a dense matmul")
    assert "from $RLPROF_PEAK_TFLOPS" in messages[0] and "set $RLPROF_PEAK_TFLOPS to the device's peak" in messages[0]


def test_cpu_peak_estimate_and_env_override(monkeypatch):
    assert cpu_peak_flops() is None or cpu_peak_flops() > 1e9
    monkeypatch.setenv("RLPROF_PEAK_TFLOPS", "2.5")
    assert peak_flops("anything") == 2.5e12


def test_gelu_pytorch_tanh_is_gated_in_gemma_but_not_in_gpt_bigcode():
    bigcode = {
        "model_type": "gpt_bigcode",
        "n_embd": 2048,
        "n_layer": 24,
        "n_head": 16,
        "n_inner": 8192,
        "vocab_size": 49152,
        "activation_function": "gelu_pytorch_tanh",
    }
    gemma = {
        "model_type": "gemma",
        "hidden_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 16384,
        "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    assert model_shape(bigcode).mlp_matrices == 2 and model_shape(gemma).mlp_matrices == 3
    per_token_mlp = 2 * 2 * 2048 * 8192  # up and down, per layer
    linear = 24 * (2 * 2 * 2048 * 2048 + 2 * 2 * 2048 * 2048 + per_token_mlp) + 2 * 2048 * 49152
    assert estimate_flops(bigcode, [1]).forward == linear + 24 * 2 * 16 * 128 * 1 * 2


def test_data_metrics_explain_the_values_and_count_aborted_responses():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    values = torch.tensor([[0.5, 1.5], [2.0, 0.0], [9.0, 9.0]])
    metrics = compute_data_metrics(
        token_level_scores=rewards,
        token_level_rewards=rewards,
        advantages=returns,
        returns=returns,
        response_mask=mask,
        prompt_lengths=torch.tensor([3, 3, 3]),
        max_response_length=2,
        max_prompt_length=8,
        values=values,
    )
    assert metrics["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert metrics["critic/score/min"] == 1.0  # the empty response's 0 is not a score
    assert metrics["response_length_non_aborted/mean"] == 1.5
    r, v = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.5, 1.5, 2.0])
    assert metrics["critic/vf_explained_var"] == pytest.approx(1 - float(torch.var(r - v) / (torch.var(r) + 1e-5)))
    assert (metrics["reward/mean"], metrics["reward/max"], metrics["reward/min"]) == (1.5, 2.0, 1.0)
    assert metrics["reward/std"] == pytest.approx(float(torch.tensor([1.0, 2.0]).std()))


def test_seed_dashboard_aliases_come_from_the_verl_names():
    from rlprof.metrics.dashboard_keys import training_aliases

    assert training_aliases(
        {
            "actor/pg_loss": 0.5,
            "critic/vf_loss": 0.25,
            "actor/entropy": 1.5,
            "actor/ppo_kl": 0.01,
            "actor/kl_loss": 0.02,
        }
    ) == {"train/loss": 0.5, "train/value_loss": 0.25, "train/entropy": 1.5, "train/kl_divergence": 0.02}
    throughput = compute_throughput_metrics(2.0, 1000, 2, num_samples=64, gen_seconds=0.5)
    assert throughput["throughput/tokens_per_sec"] == 500 and throughput["throughput/samples_per_sec"] == 32
    assert compute_memory_metrics()["memory/allocated"] > 0


def test_memory_metrics_read_cuda_peaks_without_resetting_them_unless_asked(monkeypatch):
    """CUDA is mocked here (a hardware boundary this machine lacks): only torch.cuda's counters are stand-ins."""
    resets: list[int] = []

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    metrics = compute_memory_metrics()
    assert metrics["perf/max_memory_allocated_gb"] == 3.0 == metrics["memory/allocated"]
    assert metrics["perf/max_memory_reserved_gb"] == 4.0 and metrics["perf/device_memory_total_gb"] == 80.0
    assert resets == []
    compute_memory_metrics(reset_peaks=True)
    assert resets == [1]


def test_each_phase_counts_in_its_groups_share_of_the_step():
    """rollout = gen, gen_max (ReMax's baseline), gen_refill (DAPO's later rounds), update_weights; training = the
    log-prob, value and update passes; other = the rest; unaccounted = the step minus every phase."""
    timing = {"step": 10.0, "gen": 2.0, "gen_max": 0.5, "gen_refill": 1.5, "update_weights": 1.0, "reward": 0.5}
    timing |= {"old_log_prob": 1.0, "ref": 0.5, "values": 0.5, "update_critic": 0.5, "update_actor": 1.5}
    shares = timing_shares(timing)
    assert shares == pytest.approx(
        {
            "timing_share/rollout": 0.5,
            "timing_share/training": 0.4,
            "timing_share/other": 0.05,
            "timing_share/unaccounted": 0.05,
        }
    )
