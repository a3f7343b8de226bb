"""DeepSpeed engines for the trained roles (actor, critic), and the process group they run in."""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlprof_train.workers.build_lock import warn_about_unheld_locks


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the data-parallel world, its device, and the few collectives the trainer itself uses.

    ``device`` is where this rank's models and the step's tensors live (``cuda:{local_rank}`` or ``cpu``): every
    model is made there and the step's data moves there once, when the rollout hands it over."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    memory_at_start: Optional[tuple[int, int]] = None
    """(free, total) bytes of the device when this rank joined, before any model was made (CUDA; None on the host):
    what other processes held is ``total - free``."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective when there are several ranks)."""
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def sum(self, value: float) -> float:
        """Σ over ranks of ``value`` (:func:`global_sum`)."""
        return global_sum(value, self.world_size)

    def agree(self, problem: Optional[str], error: type[Exception]) -> None:
        """Raise ``error`` on every rank when any rank found a ``problem`` (so no rank is left waiting in a
        collective); the message names the first rank that did."""
        problems = self.gather(problem)
        for rank, found in enumerate(problems):
            if found is not None:
                raise error(found if self.world_size == 1 else f"rank {rank}: {found}")


def import_deepspeed() -> Any:
    """``deepspeed``, imported without the optional ``import mlflow`` of its autotuner (which rlprof never runs): that
    import costs 2.5-3 s of every trainer process's start on 2 cores. Where mlflow is loaded already (the mlflow
    tracker), or once deepspeed is, nothing changes; afterwards ``import mlflow`` works as before."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow raises ImportError, which it catches
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed(
    device: str,
    timeout_s: float = 600.0,
    join: Optional[Callable[[str, datetime.timedelta], None]] = None,
    cuda_index: Optional[int] = None,
) -> DistEnv:
    """Join (or, run by hand, create) the process group: gloo on CPU, nccl on CUDA; a collective that waits longer
    than ``timeout_s`` for a peer raises (``trainer.collective_timeout_s``).

    torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK; a plain ``python -m`` run gets a world of
    one whose rendezvous store listens on the loopback only, on a port the kernel picks for a socket we already
    hold (no bind-then-close race). DeepSpeed would otherwise look for MPI.

    ``join(backend, timeout)``: makes the default process group itself (a pool of a split launch:
    :func:`rlprof_train.pools.join_pool`), which this process's rank and world are then of. ``cuda_index``: this
    process's GPU on a CUDA device (default: its local rank; the pools of a split launch may share GPUs,
    :func:`rlprof_train.pools.device_index`).

    DeepSpeed places the engines' modules on its accelerator, which it detects on its own (CUDA wherever a GPU is
    visible): ``DS_ACCELERATOR`` is set to ``device`` first, unless the caller set it, so that ``trainer.device=cpu``
    on a GPU machine trains on the CPU, with every model and tensor there.
    """
    os.environ.setdefault("DS_ACCELERATOR", device)
    deepspeed = import_deepspeed()

    # The engines' optimizers import torch._dynamo; imported after init_process_group it keeps the group (and gloo's
    # worker threads) alive past destroy_process_group, and a worker still freeing the last collective's tensors can
    # then abort the interpreter's exit ("terminate called without an active exception"). Import it first.
    import torch._dynamo
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    # Groups made later (DeepSpeed's data-parallel group, ...) get torch's default timeout (30 minutes), not the
    # world's: make ours the default, as no public setting does.
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if getattr(distributed_c10d, "default_pg_nccl_timeout", None) is not None:
        distributed_c10d.default_pg_nccl_timeout = timeout  # type: ignore[attr-defined]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = local_rank if cuda_index is None else cuda_index
    placed = torch.device("cuda", index) if device == "cuda" else torch.device("cpu")
    if device == "cuda":  # before the group: NCCL binds its communicator to the current device
        torch.cuda.set_device(placed)
    if join is not None:
        join("nccl" if device == "cuda" else "gloo", timeout)
    elif "RANK" not in os.environ:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore(  # type: ignore[attr-defined]  # exported at run time
            "127.0.0.1", port, world_size=1, is_master=True, master_listen_fd=listener.detach(), use_libuv=False
        )  # the store owns the listening socket from here on
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1, timeout=timeout
        )
        _KEEP_ALIVE.append(store)
    warn_about_unheld_locks()  # DeepSpeed builds its ops here (its shared-memory op on CPU) and in the engines
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", timeout=timeout)
    memory = torch.cuda.mem_get_info(placed) if device == "cuda" else None
    return DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, placed, memory)


_KEEP_ALIVE: list[Any] = []  # the single-process run's store lives as long as the process


def gathered_parameters(module: Any, zero_stage: int) -> contextlib.AbstractContextManager[Any]:
    """``module``'s whole parameters for the ``with`` block: under ZeRO 3 each rank holds a shard, gathered here
    (a collective of the engine's ranks); otherwise they are whole already."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    gathered: contextlib.AbstractContextManager[Any] = deepspeed.zero.GatheredParameters(list(module.parameters()))
    return gathered


def zero_stage_to_run(
    zero_stage: int, world_size: int, dtype: str, offload: bool, zero_checkpoint: bool = False
) -> int:
    """The ZeRO stage DeepSpeed runs: ``zero_stage``, except 0 for ZeRO 1 and 2 on one float32 process without
    offload. There ZeRO partitions the optimizer state (and gradients) over a single rank and keeps no
    mixed-precision master copy, so it saves nothing; it still copies every gradient into flat buckets and reduces
    them over the one-rank group each step (7 ms of the demo's 100 ms step, 7% of its update, measured). Stage 0
    runs the same AdamW update on the same gradients. A run resuming a ``zero_checkpoint`` (optimizer state saved by
    a ZeRO engine, e.g. before this rule) keeps ``zero_stage``: only ZeRO loads that state."""
    if world_size == 1 and zero_stage in (1, 2) and dtype == "float32" and not offload and not zero_checkpoint:
        return 0
    return zero_stage


def clips_in_optimizer(zero_stage: int, dtype: str) -> bool:
    """Whether the optimizer clips the gradient itself (:class:`ClippingAdamW`): at stage 0 in float32, where
    DeepSpeed would clip without keeping the norm (``get_global_grad_norm()`` would be None)."""
    return zero_stage == 0 and dtype == "float32"


class ClippingAdamW(torch.optim.AdamW):
    """torch's AdamW that first clips the gradient to a global norm and keeps that norm as ``_global_grad_norm``,
    which DeepSpeed's engine reports (``get_global_grad_norm()``). DeepSpeed calls ``step()`` after it has reduced
    the gradients over the ranks, so every rank clips the same averaged gradient."""

    def __init__(self, params: Any, max_norm: float, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.max_norm = max_norm
        self._global_grad_norm: Optional[torch.Tensor] = None

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self._global_grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        return super().step(closure)


def deepspeed_config(
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    grad_clip: float,
    dtype: str,
    world_size: int,
    hidden_size: Optional[int] = None,
    overlap_comm: Optional[bool] = None,
) -> dict[str, Any]:
    """The engine config: the caller owns gradient accumulation (one ``step()`` per mini-batch, however many
    micro-batches it had), so batch sizes here are nominal. ``zero_stage`` is the stage to run
    (:func:`zero_stage_to_run`); where the optimizer clips (:func:`clips_in_optimizer`), DeepSpeed does not.

    With ``hidden_size``, ZeRO's gradient bucket is sized to the model as transformers' DeepSpeed integration sizes
    it for ``"auto"`` (hidden² elements): DeepSpeed's default (5e8 elements) allocates about 1.9 GB of bucket for any
    model, measured with ``rlprof memory`` on the host allocation timeline of a ZeRO-Offload run of the tiny model.
    ZeRO 3's other sizes stay DeepSpeed's: with transformers' "auto" prefetch bucket and persistence threshold,
    DeepSpeed 0.19.8 fails with "Cannot partition a param in flight" in the two-rank ZeRO-3 run of
    ``tests/rlprof_train/test_trainer_e2e.py``. ``overlap_comm`` None leaves DeepSpeed's default."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if overlap_comm is not None and zero_stage > 0:
        zero["overlap_comm"] = overlap_comm
    if hidden_size:
        zero["reduce_bucket_size"] = hidden_size * hidden_size
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0 if clips_in_optimizer(zero_stage, dtype) else grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(
    module: torch.nn.Module,
    optim: Any,
    *,
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    grad_clip: float,
    dtype: str,
    world_size: int,
    zero_checkpoint: bool = False,
    overlap_comm: Optional[bool] = None,
) -> Any:
    """A DeepSpeed engine around ``module`` at :func:`zero_stage_to_run`'s stage, with AdamW: DeepSpeed's CPU Adam
    when the optimizer is offloaded; otherwise torch's AdamW (no extension build), its fused kernel where
    ``optim.fused`` (the same update up to float rounding, one pass over each tensor; transformers' default)."""
    deepspeed = import_deepspeed()

    stage = zero_stage_to_run(zero_stage, world_size, dtype, offload_optimizer or offload_param, zero_checkpoint)
    hidden_size = getattr(getattr(module, "config", None), "hidden_size", None)
    config = deepspeed_config(
        stage, offload_optimizer, offload_param, grad_clip, dtype, world_size, hidden_size, overlap_comm
    )
    trainable = [p for p in module.parameters() if p.requires_grad]  # with LoRA: the adapters only
    if offload_optimizer:
        params = dict(lr=optim.lr, weight_decay=optim.weight_decay, betas=list(optim.betas))
        config["optimizer"] = {"type": "AdamW", "params": params}
        engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=config)
        return engine
    betas = (float(optim.betas[0]), float(optim.betas[1]))
    kernel: dict[str, Any] = dict(fused=optim.fused, foreach=None if optim.fused else False)
    optimizer = (
        ClippingAdamW(trainable, grad_clip, lr=optim.lr, betas=betas, weight_decay=optim.weight_decay, **kernel)
        if clips_in_optimizer(stage, dtype)
        else torch.optim.AdamW(trainable, lr=optim.lr, betas=betas, weight_decay=optim.weight_decay, **kernel)
    )
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


def global_sum(value: float, world_size: int) -> float:
    """Σ over ranks of ``value`` (a collective when world_size > 1)."""
    if world_size == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(total)
    return float(total)


def _collective_device() -> torch.device:
    """Where a tensor for a collective of the default group must be: NCCL reduces device tensors only."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def activation_offload(enabled: bool) -> Any:
    """Saved activations go to pinned host memory during the pass (GPU); nothing to move on CPU."""
    if enabled and torch.cuda.is_available():
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def mini_batches(size: int, mini_size: int, epochs: int, shuffle: bool, seed: int) -> Iterator[list[int]]:
    """Row indices of every mini-batch: ``epochs`` passes over ``size`` rows, cut into runs of ``mini_size``
    (reshuffled each pass when ``shuffle``, from ``seed``)."""
    rng = random.Random(seed)
    for _ in range(epochs):
        rows = list(range(size))
        if shuffle:
            rng.shuffle(rows)
        for start in range(0, size, mini_size):
            yield rows[start : start + mini_size]


def loss_counts(response_mask: torch.Tensor, world_size: int) -> dict[str, float]:
    """The mini-batch's token and sequence counts over all ranks, for :func:`rlprof_train.algos.agg_loss`
    (sequences: those with at least one response token)."""
    return dict(
        total_tokens=global_sum(float(response_mask.sum()), world_size),
        total_seqs=global_sum(float((response_mask.sum(-1) > 0).sum()), world_size),
        norm_length=float(response_mask.shape[1]),
    )


def set_learning_rate(engine: Any, lr: float) -> None:
    """The learning rate of every parameter group of ``engine``'s optimizer (DeepSpeed's ZeRO and bf16 optimizers
    share their wrapped optimizer's groups)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(engine: Any, role: str, agg: Any) -> None:
    """``engine.step()``, then ``{role}/grad_norm`` (when DeepSpeed reports it) and ``{role}/lr`` into ``agg``."""
    from rlprof.metrics import Reduce

    engine.step()
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        agg.add(f"{role}/grad_norm", float(grad_norm), Reduce.MEAN)
    agg.add(f"{role}/lr", engine.optimizer.param_groups[0]["lr"], Reduce.LAST)
