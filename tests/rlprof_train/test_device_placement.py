"""The trainer keeps every tensor where its models are: the real trainer, built and trained in this process for two
steps (validation and a checkpoint included) with its models on ``cuda``, in every configuration a GPU user runs.

Each case runs twice where it can: on a machine without CUDA, on a **simulated** CUDA device (:mod:`simulated_cuda`),
which raises :class:`~simulated_cuda.DeviceMismatch` wherever a real GPU would raise "Expected all tensors to be on
the same device" (before device placement was written, the first rollout failed so: the prompts stayed on the host,
as on an H200); on a machine with one (``-m gpu``, scripts/gpu_kit.sh), on the **real** device, bf16 and ZeRO 3
included.

Simulated, named as such: DeepSpeed builds its engines on its CPU accelerator here, so each engine's module is moved to
``cuda`` after, as DeepSpeed moves it on a GPU machine; its ZeRO and bf16 buffers stay on the host, so stage 0 in
float32 is what the simulation runs (ZeRO 3 and bf16: the real device only)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from rlprof_train.config.load import load_trainer_config
from rlprof_train.workers.engine import DistEnv
from rlprof_train.workers.rollout.static_decode import StaticDecoder

from conftest import build_reward_model, world_of_one
from simulated_cuda import SIMULATED, DeviceMismatch, SimulatedCuda, on_device

pytestmark = pytest.mark.slow  # trainer runs of about a minute in all: out of the quick loop

SMALL = (
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=2",
    "data.val_batch_size=8",
    "trainer.save_freq=2",
    'trainer.logger=["file"]',
)


class Placement(NamedTuple):
    env: DistEnv
    simulated: bool


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            "simulated",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here: see the cuda runs"),
        ),
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def placement(request) -> Iterator[Placement]:
    """This process's world of one on ``cuda:0``: simulated on the CPU, or the real device."""
    if request.param == "cuda":
        with world_of_one("cuda") as env:
            yield Placement(env, simulated=False)
        return
    with world_of_one("cpu") as env:
        yield Placement(dataclasses.replace(env, device=SIMULATED), simulated=True)


def is_on_device(tensor: torch.Tensor, placement: Placement) -> bool:
    return on_device(tensor) if placement.simulated else tensor.is_cuda


def train(tmp_path, placement: Placement, *overrides: str, config: str = "demo"):
    """The trainer built and trained in this process where ``placement`` says (the host when its device is the CPU);
    returns it and its metrics records."""
    from rlprof_train.trainer import PPOTrainer

    cfg = load_trainer_config(
        [
            f"--config-name={config}",
            *SMALL,
            f"trainer.log_dir={tmp_path / 'logs'}",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            *overrides,
        ]
    )
    if not placement.simulated:
        trainer = PPOTrainer(cfg, placement.env, "real", lambda line: None)
        trainer.fit()
    else:
        with SimulatedCuda() as mode:
            trainer = PPOTrainer(cfg, placement.env, "simulated", lambda line: None)
            for worker in (trainer.actor, trainer.critic):
                if worker is not None:
                    worker.engine.module.to("cuda")  # what DeepSpeed does with the module on a GPU machine
            trainer.fit()
        assert mode.calls > 1000  # the mode really saw the training
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    return trainer, records


CASES = {
    "grpo": (),
    "gae_critic_dynamic_batches": (
        "algorithm.adv_estimator=gae",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=64",
    ),
    "remove_padding": (
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    ),
    "remax_kl_in_reward_entropy_checkpointing": (
        "algorithm.adv_estimator=remax",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.entropy_checkpointing=true",
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ),
    "lora": ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"),
    "compiled_rollout": ("actor_rollout_ref.rollout.enforce_eager=false",),
}
COMPILED = {"compiled_rollout"}
"""Cases whose step is compiled: ``torch.compile`` traces below the simulation's torch-function level, so on the CPU
the simulation checks the step's eager form (the same forward on the same static cache); the device runs it compiled."""
REAL_DEVICE_ONLY = {  # DeepSpeed's own buffers are made on its accelerator: CUDA on a GPU machine
    "bf16_zero1_gae_offload_activations": (
        "actor_rollout_ref.model.dtype=bfloat16",
        "actor_rollout_ref.actor.zero_stage=1",
        "critic.zero_stage=1",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.enable_activation_offload=true",
    ),
    "zero3": ("actor_rollout_ref.actor.zero_stage=3", "actor_rollout_ref.model.dtype=bfloat16"),
    "fast_paths_bf16": (  # the compiled decode (CUDA graphs), the compiled training forward, bf16 with fp32 master
        "actor_rollout_ref.rollout.enforce_eager=false",
        "actor_rollout_ref.model.torch_compile=true",
        "actor_rollout_ref.model.dtype=bfloat16",
    ),
}


def check_placed(trainer, records, placement: Placement) -> None:
    assert is_on_device(next(trainer.actor.module.parameters()), placement)
    if trainer.ref is not None and trainer.ref.lora_policy is None:
        assert is_on_device(next(trainer.ref.model.parameters()), placement)  # made there, not moved by the test
    if trainer.critic is not None:
        assert is_on_device(next(trainer.critic.engine.module.parameters()), placement)
    assert [r["training/global_step"] for r in records if "actor/pg_loss" in r] == [1.0, 2.0]
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in records if "actor/pg_loss" in r)  # finite
    assert any(key.startswith("val-core/") for key in records[-1])  # validation ran on the device too


@pytest.mark.parametrize("case", CASES)
def test_the_trainer_keeps_every_tensor_on_the_device(tmp_path, placement, case, monkeypatch):
    if placement.simulated and case in COMPILED:
        monkeypatch.setattr(StaticDecoder, "compiled_forward", lambda _self, model: model.forward)
    trainer, records = train(tmp_path, placement, *CASES[case])
    check_placed(trainer, records, placement)
    assert (tmp_path / "ckpt" / "global_step_2").is_dir()
    if not placement.simulated:  # what the device held before the run (other processes: an OOM names them)
        at_start = json.loads((tmp_path / "logs" / "run.json").read_text())["device_memory_at_start"]
        assert 0 < at_start["free"] <= at_start["total"] == torch.cuda.get_device_properties(0).total_memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", REAL_DEVICE_ONLY)
def test_bf16_and_zero_on_the_real_device(tmp_path, placement, case):
    trainer, records = train(tmp_path, placement, *REAL_DEVICE_ONLY[case])
    check_placed(trainer, records, placement)
    assert records[-1]["perf/max_memory_allocated_gb"] > 0


def test_a_reward_model_scores_on_the_device(tmp_path, placement):
    model = build_reward_model(tmp_path / "rm", ["3+4=7", "1+1=2", "0+2=2", "9+9=18"])
    trainer, records = train(
        tmp_path, placement, "reward_model.enable=true", f"reward_model.model.path={model}", "trainer.save_freq=-1"
    )
    assert trainer.reward.model is not None
    assert is_on_device(next(trainer.reward.model.model.parameters()), placement)
    assert len(records) == 2


def test_multi_turn_tool_rollouts_stay_on_the_device(tmp_path, placement):
    _, records = train(
        tmp_path,
        placement,
        "data.max_response_length=24",
        "trainer.total_training_steps=1",  # a step of turns is what differs from the cases above
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        config="tool_demo",
    )
    assert [r["training/global_step"] for r in records] == [1.0]
    assert records[-1]["num_turns/mean"] >= 2  # tool calls really happened between the turns


@pytest.mark.skipif(torch.cuda.is_available(), reason="the simulation runs where there is no CUDA device")
def test_the_simulation_moves_nothing_but_placement(tmp_path, placement):
    """The simulated run computes what the same run computes on the host, to the last bit: only placement is
    simulated."""
    overrides = ("algorithm.adv_estimator=gae", "actor_rollout_ref.model.use_remove_padding=true")
    _, simulated = train(tmp_path / "simulated", placement, *overrides)
    host = Placement(dataclasses.replace(placement.env, device=torch.device("cpu")), simulated=False)
    _, on_host = train(tmp_path / "host", host, *overrides)
    keys = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss", "critic/grad_norm")
    assert [{k: r[k] for k in keys} for r in simulated] == [{k: r[k] for k in keys} for r in on_host]
    assert on_host[-1]["actor/grad_norm"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the GPU kit resumes a real one on the host")
def test_a_checkpoint_written_on_a_gpu_resumes_on_the_host(tmp_path, placement, monkeypatch):
    """A GPU's checkpoint files tag every storage ``cuda:0`` (torch.save's location tag), which a CPU machine cannot
    load as saved; resuming from one on the host continues the run. Written here with the tag a GPU writes."""
    host = Placement(dataclasses.replace(placement.env, device=torch.device("cpu")), simulated=False)
    with monkeypatch.context() as gpu:
        gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        train(tmp_path, host)
    (saved,) = (tmp_path / "ckpt" / "global_step_2" / "actor").glob("*model_states.pt")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(saved, weights_only=False)  # as written: on a CUDA device
    _, records = train(tmp_path, host, "trainer.total_training_steps=3", "trainer.save_freq=-1")
    assert [r["training/global_step"] for r in records if "actor/pg_loss" in r] == [1.0, 2.0, 3.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the simulation runs where there is no CUDA device")
def test_the_simulation_raises_where_cuda_raises():
    """The check can fail: a rollout whose prompts stay on the host while its model is on the device (what the
    trainer did before), and the mixing rules CUDA has."""
    from rlprof_train.data import Example
    from rlprof_train.models import load_causal_lm, load_tokenizer
    from rlprof_train.prepare import EMBEDDED_MODEL_DIR
    from rlprof_train.tiny_model import ensure_tiny_model
    from rlprof_train.workers.rollout import SamplingParams
    from rlprof_train.workers.rollout.hf import HFRollout

    folder = ensure_tiny_model(EMBEDDED_MODEL_DIR, 4, "arithmetic")
    tokenizer = load_tokenizer(folder)
    prompt = Example(0, tuple(tokenizer("3+4=", add_special_tokens=False)["input_ids"]), "rlprof/arithmetic", "7")
    with SimulatedCuda():
        model = load_causal_lm(folder, device=SIMULATED).eval()
        host = HFRollout(lambda: model, tokenizer, 0, None, torch.device("cpu"))
        with pytest.raises(DeviceMismatch, match="embedding: expected all tensors on one device"):
            host.generate([prompt], SamplingParams(2, 1.0, 1.0, -1, 4))
        device = HFRollout(lambda: model, tokenizer, 0, None, SIMULATED)
        assert device.generate([prompt], SamplingParams(2, 1.0, 1.0, -1, 4)).input_ids.shape[0] == 2

        on, off = torch.ones(3, device="cuda"), torch.ones(3)
        with pytest.raises(DeviceMismatch):
            on + off
        with pytest.raises(DeviceMismatch):
            off[torch.zeros(1, dtype=torch.long, device="cuda")]
        with pytest.raises(DeviceMismatch):
            on.numpy()
        assert on_device(on + torch.tensor(2.0))  # a host scalar mixes, as in CUDA
        assert on_device(on[torch.tensor([0, 2])])  # host indices into a device tensor, as in CUDA
        assert not on_device(on.cpu()) and on_device(off.to("cuda")) and on_device(torch.zeros_like(on))
        off[:] = on  # a copy across devices
        with pytest.raises(DeviceMismatch, match="a cpu generator drawing into a cuda tensor"):
            on.exponential_(1, generator=torch.Generator(device="cpu"))
        with pytest.raises(DeviceMismatch, match="a cuda generator drawing into a cpu tensor"):
            off.exponential_(1, generator=torch.Generator(device="cuda"))
        assert on_device(on.exponential_(1, generator=torch.Generator(device="cuda")))


CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use."
)


@pytest.mark.slow  # a trainer of 4 steps, then resumed: about 40 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the real allocator runs out (the GPU kit)")
def test_out_of_memory_in_a_step_is_one_line_and_a_resume_goes_on(tmp_path, placement, monkeypatch, capsys):
    """The device running out of memory in the actor's update at step 3 (the allocator's error, raised at the
    hardware boundary, as torch raises it): the run ends with a line naming the step, role, phase and bytes, that
    torch_memory was off, and an override (without a snapshot: the seed's first memory setting for the role); exit
    code 3; the checkpoint of step 2 intact; resumed with the override,
    the run goes on from step 3."""
    from rlprof_train.config import as_dict
    from rlprof_train.main_ppo import train as run_training
    from rlprof_train.progress import Progress
    from rlprof_train.trainer import PPOTrainer
    from rlprof_train.workers.actor import ActorWorker

    host = dataclasses.replace(placement.env, device=torch.device("cpu"))
    overrides = [
        "--config-name=demo",
        *SMALL,
        "trainer.total_training_steps=4",
        "trainer.test_freq=-1",
        f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    cfg = load_trainer_config(overrides)
    real_step = ActorWorker._micro_step

    def allocate(self, micro, counts, metrics):
        if trainer.step == 3:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return real_step(self, micro, counts, metrics)

    monkeypatch.setattr(ActorWorker, "_micro_step", allocate)
    progress = Progress(0, 1, 60.0)
    trainer = PPOTrainer(cfg, host, "oom", lambda line: None, progress)
    assert run_training(trainer.fit, 0, progress, as_dict(cfg)) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error on rank 0: out of memory on the device in step 3, actor update_actor"), last
    assert "(2.000 GiB requested, 1.060 GiB free)" in last and "torch_memory was off" in last
    fix = last.split("; try ")[1].split(", then resume")[0]
    assert fix == "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true", last  # the seed's first for an OOM
    assert (tmp_path / "ckpt" / "global_step_2").is_dir() and not (tmp_path / "ckpt" / "global_step_3").exists()

    monkeypatch.setattr(ActorWorker, "_micro_step", real_step)
    resumed = PPOTrainer(load_trainer_config([*overrides, fix]), host, "resumed", lambda line: None)
    assert resumed.start_step == 3
    resumed.fit()
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in records] == [1.0, 2.0, 3.0, 4.0]
