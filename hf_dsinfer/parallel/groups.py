"""Process groups for tensor (and expert) parallelism, and the collectives fused blocks call.

The world is the torch.distributed default group that torchrun / `accelerate launch` set up
(NCCL on GPUs, gloo on CPUs). A `RankGroup` is one slice of it: `rank_group(size)` partitions the
world into consecutive groups of `size` ranks (tensor parallelism: ranks 0..tp-1, tp..2tp-1, ...);
`rank_group(size, stride=tp)` gives the orthogonal groups (ranks with the same tensor-parallel
index), which is what expert parallelism combined with tensor parallelism needs.

`new_group` is a collective over the whole world, so every rank must build the same groups in
the same order: groups are built once per (size, stride) for all ranks and cached.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import time

import torch
import torch.distributed as dist

from hf_dsinfer.errors import TensorParallelError

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_GROUPS: dict[tuple[int, int], tuple[tuple[int, ...], dist.ProcessGroup]] = {}



@dataclasses.dataclass(frozen=True)
class RankGroup:
    """This process's place in one group of ranks.

    Attributes:
        group: the torch.distributed group (None only for size 1: no collectives needed).
        rank: this process's index inside the group (0 .. size-1).
        size: number of ranks in the group.
        ranks: the global ranks of the group, in index order.
        device: where collectives' tensors live (cuda:<local rank> under NCCL, else cpu).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x` (a fresh, contiguous activation)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_uneven(self, x: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (of size sizes[r] along `dim`) along `dim`, in rank order.

        gloo's all_gather needs equal shapes, so uneven shards are padded to the largest."""
        if self.size == 1:
            return x
        dim = dim % x.dim()
        width = max(sizes)
        pad = x.new_zeros((*x.shape[:dim], width, *x.shape[dim + 1:]))
        pad.narrow(dim, 0, x.shape[dim]).copy_(x)
        parts = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite `x` on every rank with the group's first rank's `x` (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.group)
        return x


def collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Seen here and in CI (about 1 gloo launch in 20): a ProcessGroupGloo worker thread that finishes
# a collective drops its work item, and with it the last reference to a tensor whose Python
# object only the C++ side still holds; that decref needs the GIL. When the main thread leaves
# the script within a GIL switch interval of the last collective, the worker thread asks for the
# GIL during interpreter finalization, Python ends it with pthread_exit, the unwind meets a
# noexcept frame and the process aborts ("terminate called without an active exception") after
# all its work is done. Releasing the GIL once at exit lets such a thread finish first.
_COLLECTIVES_USED = False
_EXIT_GRACE_S = 0.05


@atexit.register
def _let_collective_threads_finish() -> None:
    if _COLLECTIVES_USED:
        time.sleep(_EXIT_GRACE_S)


def ensure_world(what: str) -> int:
    """The world size, initialising torch.distributed from a torchrun environment if needed."""
    if not dist.is_available():
        raise TensorParallelError(f"{what} needs torch.distributed, which this torch build lacks.")
    if not dist.is_initialized():
        if not all(name in os.environ for name in _TORCHRUN_ENV):
            raise TensorParallelError(
                f"{what} needs a torch.distributed process group: none is initialised and no "
                f"torchrun environment ({', '.join(_TORCHRUN_ENV)}) was found. Fix: launch with "
                "`torchrun --nproc-per-node N script.py` or `accelerate launch`, or call "
                "torch.distributed.init_process_group() before loading the model."
            )
        _init_from_env()
    global _COLLECTIVES_USED
    _COLLECTIVES_USED = True
    return dist.get_world_size()


def _init_from_env() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def rank_group(size: int, stride: int = 1, what: str = "tensor parallelism") -> RankGroup:
    """This rank's group among the world's groups of `size` ranks spaced `stride` apart.

    The world is cut into blocks of size * stride consecutive ranks; inside a block, group j
    (0 <= j < stride) holds ranks j, j + stride, ..., j + (size-1) * stride.
    """
    world = ensure_world(what) if size > 1 else (dist.get_world_size() if _ready() else 1)
    if size < 1 or world % (size * stride):
        raise TensorParallelError(
            f"{what}: a group of {size} ranks (stride {stride}) must tile the world of {world} "
            f"process(es), got world % {size * stride} = {world % (size * stride)}. Fix: use a "
            f"size that divides the world: {_divisors(world // stride)}, or launch "
            f"{size * stride} processes (torchrun --nproc-per-node {size * stride})."
        )
    me = dist.get_rank() if _ready() else 0
    if size == 1:
        return RankGroup(None, 0, 1, (me,), collective_device() if _ready() else _cpu())
    ranks, group = _build(size, stride, world, me)
    return RankGroup(group, ranks.index(me), size, ranks, collective_device())


def _build(size: int, stride: int, world: int, me: int):
    key = (size, stride)
    if key not in _GROUPS:
        mine = None
        for block in range(0, world, size * stride):
            for j in range(stride):
                ranks = tuple(block + j + i * stride for i in range(size))
                group = dist.group.WORLD if size == world else dist.new_group(list(ranks))
                if me in ranks:
                    mine = (ranks, group)
        _GROUPS[key] = mine
    return _GROUPS[key]


def tensor_parallel_group(tp_size: int) -> RankGroup:
    """The tensor-parallel group of this rank: consecutive ranks [k*tp, (k+1)*tp)."""
    if tp_size > 1:
        world = ensure_world(f"tp_size={tp_size}")
        if tp_size > world:
            raise TensorParallelError(
                f"tp_size={tp_size} is larger than the world size {world} (processes launched). "
                f"Fix: launch {tp_size} processes (torchrun --nproc-per-node {tp_size}), or use "
                f"tp_size in {_divisors(world)}."
            )
    return rank_group(tp_size, 1, f"tp_size={tp_size}")


def _ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _cpu() -> torch.device:
    return torch.device("cpu")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
