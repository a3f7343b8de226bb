"""The two pools of a run whose rollout is apart from its trainer (the one-step-off trainer), in one launch.

A launch of ``W`` processes (torchrun or the deepspeed launcher, several nodes included) is split by global rank:
the first ``W - R`` train, the last ``R = rollout.nnodes * rollout.n_gpus_per_node`` generate. Each pool has a process
group of its own, made over the launch's rendezvous store under the pool's prefix with the pool's own ranks
(``0 .. size - 1``), so DeepSpeed, the trainer's collectives and its stall reports see one pool only. Two gloo groups
join the pools (:class:`Link`): ``orders`` (trainer rank 0 and every rollout process: what to generate, the weights)
and ``batches`` (every process: the generated batches, to every trainer rank). Both carry host memory. On GPUs, each
process has a GPU of its own where the node has one for each (its local rank), and the weights go from trainer rank
0's GPU to the rollout processes' over a third group, ``weights`` (NCCL, the same members as ``orders``); where a node
has fewer GPUs than processes, the pools share them (:func:`device_index`: one GPU holds a process of each pool, as on
a one-GPU machine) and the weights cross as host copies over ``orders`` (NCCL takes one rank a GPU, and trainer rank 0
shares its GPU with a rollout process: :func:`weights_on_gpus`).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from rlprof.typed_config import ConfigError

PoolName = Literal["trainer", "rollout"]


@dataclass(frozen=True)
class Pool:
    """This process's pool and its place in it and in the launch."""

    name: PoolName
    rank: int
    """Rank within the pool."""
    size: int
    """Processes of the pool."""
    global_rank: int
    """Rank within the launch."""
    world_size: int
    """Processes of the launch (both pools)."""

    @property
    def rollout_size(self) -> int:
        return self.size if self.name == "rollout" else self.world_size - self.size


def pool_of(global_rank: int, world_size: int, rollout_size: int) -> Pool:
    """The pool of launch rank ``global_rank``: the last ``rollout_size`` ranks generate, the others train."""
    trainer_size = world_size - rollout_size
    if global_rank < trainer_size:
        return Pool("trainer", global_rank, trainer_size, global_rank, world_size)
    return Pool("rollout", global_rank - trainer_size, rollout_size, global_rank, world_size)


def pool_sizes_on_node(node: int, per_node: int, trainer_size: int) -> tuple[int, int]:
    """(trainer processes, rollout processes) on node ``node`` of a launch of ``per_node`` processes a node, whose
    first ``trainer_size`` launch ranks train (nodes hold launch ranks in order)."""
    trainers = min(max(trainer_size - node * per_node, 0), per_node)
    return trainers, per_node - trainers


def device_index(pool: Pool, per_node: int, local_rank: int, visible: int) -> int:
    """This process's GPU on its node. A GPU for each process of the node: its local rank (the pools on GPUs of
    their own). Fewer: the pools share the node's GPUs, each pool's processes on the node taking GPUs 0, 1, ... (its
    index among them); :func:`sharing_problem` checks that each pool has a GPU for each of its processes there."""
    if per_node <= visible:
        return local_rank
    trainers, _ = pool_sizes_on_node(pool.global_rank // per_node, per_node, pool.world_size - pool.rollout_size)
    return local_rank if pool.name == "trainer" else local_rank - trainers


def sharing_problem(world_size: int, per_node: int, rollout_size: int, visible: int) -> Optional[str]:
    """Why the pools cannot share a node's ``visible`` GPUs (None: they can, or need not): two processes of one
    pool on one GPU (a process group has one rank a device)."""
    if per_node <= visible:
        return None
    for node in range(max(world_size // per_node, 1)):
        trainers, rollouts = pool_sizes_on_node(node, per_node, world_size - rollout_size)
        if max(trainers, rollouts) > visible:
            return (
                f"{per_node} processes on a node with {visible} GPU{'s' if visible != 1 else ''}: the pools share "
                f"a node's GPUs, each needing one for each of its processes there, and node {node} has {trainers} "
                f"trainer and {rollouts} rollout processes; launch fewer, or give each pool at most {visible} a node"
            )
    return None


def weights_on_gpus(device: str, per_node: int, visible: int) -> bool:
    """Whether the weights cross GPU to GPU (an NCCL group): on CUDA where each of a node's ``per_node`` processes has
    one of its ``visible`` GPUs to itself. Where the pools share GPUs, trainer rank 0 and a rollout process are on one
    GPU, which an NCCL group cannot hold twice: the weights cross as host copies over gloo."""
    return device == "cuda" and per_node <= visible


def rollout_pool_size(nnodes: int, n_gpus_per_node: int, world_size: int) -> int:
    """``rollout.nnodes * rollout.n_gpus_per_node`` processes, checked to leave the trainer at least one; else a
    :class:`ConfigError` naming both keys, the launch and what is allowed."""
    size = nnodes * n_gpus_per_node
    if not 1 <= size < world_size:
        raise ConfigError(
            f"rollout.nnodes={nnodes} x rollout.n_gpus_per_node={n_gpus_per_node}: the rollout pool must have 1 to "
            f"{max(world_size - 1, 1)} of the launch's {world_size} processes (the others train); launch more "
            "processes (torchrun --nproc_per_node) or give the rollout fewer"
        )
    return size


def join_pool(
    pool: Pool, backend: str, timeout: datetime.timedelta, weights_device: Optional[torch.device] = None
) -> Link:
    """Make this process's pool group the default process group (pool ranks), and the link between the pools
    (``weights_device``: this process's GPU where the weights cross GPU to GPU, :func:`weights_on_gpus`).

    The launcher's rendezvous (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, torchrun's agent store) gives the store
    all of them are made over. ``RANK`` and ``WORLD_SIZE`` are then the pool's, as DeepSpeed reads them."""
    import os

    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    store, _, _ = next(
        dist.rendezvous(  # type: ignore[attr-defined]  # exported at run time
            "env://", pool.global_rank, pool.world_size, timeout=timeout
        )
    )
    dist.init_process_group(
        backend,
        store=PrefixStore(f"pool/{pool.name}/", store),
        rank=pool.rank,
        world_size=pool.size,
        timeout=timeout,
    )
    os.environ.update(RANK=str(pool.rank), WORLD_SIZE=str(pool.size))
    return Link(store, pool, timeout, weights_device)


class Link:
    """The groups between the pools. ``orders``: trainer rank 0 (its rank 0) and the rollout processes (1 + their
    pool rank); ``batches``: every process by launch rank; ``weights`` (with a ``weights_device``): the members of
    ``orders``, over NCCL on their GPUs. Every call is a collective of its group, made in the same order by every
    member; a peer that is gone makes it raise (within the collective timeout)."""

    def __init__(
        self, store: Any, pool: Pool, timeout: datetime.timedelta, weights_device: Optional[torch.device] = None
    ) -> None:
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore

        self.pool = pool
        self.mailbox = PrefixStore("link/mailbox/", store)
        """Counts the orders sent (:meth:`pending`: a rollout process that generates between orders asks it)."""
        self.received = 0
        self.batches: Any = dist.ProcessGroupGloo(
            PrefixStore("link/batches/", store), pool.global_rank, pool.world_size, timeout
        )
        in_orders = pool.name == "rollout" or pool.rank == 0
        self.orders: Optional[Any] = None
        self.weights: Optional[Any] = None
        self.weights_device = torch.device("cpu")
        """Where the weights cross: this process's GPU over ``weights``, else the host over ``orders``."""
        if in_orders:
            rank = 1 + pool.rank if pool.name == "rollout" else 0
            prefix = PrefixStore("link/orders/", store)
            self.orders = dist.ProcessGroupGloo(prefix, rank, 1 + pool.rollout_size, timeout)
            if weights_device is not None:
                options = dist.ProcessGroupNCCL.Options()  # CUDA builds only
                options._timeout = timeout
                self.weights = dist.ProcessGroupNCCL(
                    PrefixStore("link/weights/", store), rank, 1 + pool.rollout_size, options
                )
                self.weights_device = weights_device

    # ------------------------------------------------------------------------------------------------ orders

    def send(self, message: Any) -> None:
        """Trainer rank 0: ``message`` to every rollout process."""
        self.mailbox.add("sent", 1)
        self._broadcast_bytes(pickle.dumps(message))

    def receive(self) -> Any:
        """A rollout process: the next message trainer rank 0 sent."""
        message = pickle.loads(self._broadcast_bytes(None))
        self.received += 1
        return message

    def pending(self) -> bool:
        """A rollout process: whether trainer rank 0 has sent an order this process has not received (one round trip
        to the launch's store; the order's collective waits for this process until it calls :meth:`receive`)."""
        return int(self.mailbox.add("sent", 0)) > self.received

    def _broadcast_bytes(self, data: Optional[bytes]) -> bytes:
        """``data`` from the sender (rank 0 of ``orders``); every other member passes None and gets them."""
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._broadcast(length)
        buffer = (
            torch.empty(int(length), dtype=torch.uint8)
            if data is None
            else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        )
        self._broadcast(buffer)
        return buffer.numpy().tobytes()

    def send_weights(self, tensors: Sequence[torch.Tensor]) -> int:
        """Trainer rank 0: ``tensors`` (the policy's parameters, in ``named_parameters`` order) to every rollout
        process, one flat buffer per dtype on :attr:`weights_device`; the bytes sent."""
        sent = 0
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            flat = torch.cat([t.detach().reshape(-1).to(self.weights_device) for t in tensors if t.dtype == dtype])
            self._broadcast_weights(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    @torch.no_grad()
    def receive_weights(self, tensors: Sequence[torch.Tensor]) -> int:
        """A rollout process: the weights :meth:`send_weights` sent, copied into ``tensors`` (the same parameters,
        in the same order); the bytes received."""
        received = 0
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.empty(sum(t.numel() for t in same), dtype=dtype, device=self.weights_device)
            self._broadcast_weights(flat)
            received += flat.numel() * flat.element_size()
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return received

    def _broadcast_weights(self, tensor: torch.Tensor) -> None:
        self._broadcast(tensor, self.weights)

    def _broadcast(self, tensor: torch.Tensor, group: Optional[Any] = None) -> None:
        """``tensor`` from rank 0 of ``group`` (default ``orders``) to its other members."""
        import torch.distributed as dist

        assert self.orders is not None, "only trainer rank 0 and the rollout processes are in the orders group"
        options = dist.BroadcastOptions()
        options.rootRank = 0
        (group or self.orders).broadcast([tensor], options).wait()

    # ------------------------------------------------------------------------------------------------ batches

    def exchange(self, payload: Any) -> list[Any]:
        """Every process: what each rollout process gave (trainer processes give None), in rollout rank order."""
        data = pickle.dumps(payload)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.pool.world_size)]
        self.batches.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        width = int(max(s.item() for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = [torch.empty(width, dtype=torch.uint8) for _ in range(self.pool.world_size)]
        self.batches.allgather([everyone], [mine]).wait()
        first_rollout = self.pool.world_size - self.pool.rollout_size
        return [
            pickle.loads(everyone[rank][: int(sizes[rank].item())].numpy().tobytes())
            for rank in range(first_rollout, self.pool.world_size)
        ]
