"""Tensor slicing, Megatron-style: which rows / columns of each weight a rank keeps.

A `ShardSpec` names a dim and the index ranges along it that a rank keeps, concatenated in order.
The same spec slices an in-memory tensor (`take`) or drives the reads of only those bytes from a
safetensors file (loading.CheckpointReader), so in-place sharding and sharded loading cannot
disagree.

Attention is split by query heads: rank r gets a contiguous, balanced run of query heads (sizes
differ by at most one, so heads need not divide by tp) plus the KV heads those queries read.
When a rank's query heads draw equally on each KV head they touch, it keeps those KV heads once
(GQA groups split or replicated across ranks when tp > num_kv_heads); otherwise it keeps one KV
head per query head (a local MHA layout), which is always exact.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_dsinfer.errors import TensorParallelError

Ranges = tuple[tuple[int, int], ...]


def split_sizes(n: int, parts: int) -> list[int]:
    """n items over `parts` ranks, balanced: the first n % parts ranks get one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    sizes = split_sizes(n, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    """Join touching ranges: [(0, 16), (16, 32)] -> ((0, 32),). Duplicates stay (replicas)."""
    merged: list[tuple[int, int]] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Keep `ranges` (concatenated in order) of dimension `dim`."""

    dim: int
    ranges: Ranges

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [tensor.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)).clone()


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes.

    q: [start, stop) of the query heads; kv: the KV heads it keeps, in local order (a KV head
    appears twice when the local MHA layout needs it for two query heads)."""

    q: tuple[int, int]
    kv: tuple[int, ...]

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    if tp > num_heads:
        raise TensorParallelError(
            f"tp_size={tp} is larger than the {num_heads} attention heads: a rank would hold no "
            f"head. Fix: use tp_size in {list(range(1, num_heads + 1))} (uneven splits are fine)."
        )
    q0, q1 = shard_range(num_heads, tp, rank)
    group = num_heads // num_kv_heads  # query heads per KV head
    wanted = [h // group for h in range(q0, q1)]  # KV head each local query head reads
    touched = sorted(set(wanted))
    counts = {kv: wanted.count(kv) for kv in touched}
    if len(set(counts.values())) == 1:  # each KV head serves the same number of local queries
        return HeadShard((q0, q1), tuple(touched))
    return HeadShard((q0, q1), tuple(wanted))


def head_ranges(heads: list[int] | tuple[int, ...], head_dim: int, offset: int = 0,
                width: int | None = None) -> list[tuple[int, int]]:
    """Index ranges of `heads` (each `width` wide, default head_dim) starting at `offset`."""
    width = head_dim if width is None else width
    return [(offset + h * width, offset + (h + 1) * width) for h in heads]


def qkv_ranges(layout: str, heads: HeadShard, num_heads: int, head_dim: int,
               num_kv_heads: int | None = None) -> list[Ranges]:
    """Output-feature ranges this rank keeps of the Q/K/V projections.

    separate: one entry each for q, k, v; packed [q|k|v]: one entry for the single fused
    projection (MHA only, as in GPT-2);
    packed_gqa [q | k | v] with num_kv_heads k and v heads (Phi-3): one entry, this rank's q
    heads, then its KV heads' rows of k and of v; grouped_gqa, per KV head [q x group, k, v]
    (Falcon): one entry, per local KV head its local q heads' rows, then its k and v rows (the
    local projection is grouped again, with the local counts)."""
    from hf_dsinfer.injection import policy as P  # policies are data; import kept local

    q_heads = list(range(*heads.q))
    if layout == P.SEPARATE:
        kv = _merge(head_ranges(heads.kv, head_dim))
        return [_merge(head_ranges(q_heads, head_dim)), kv, kv]
    if layout == P.PACKED_GQA:
        k_at, v_at = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        return [_merge(head_ranges(q_heads, head_dim) + head_ranges(heads.kv, head_dim, k_at)
                       + head_ranges(heads.kv, head_dim, v_at))]
    if layout == P.GROUPED_GQA:
        group = num_heads // num_kv_heads
        per = heads.num_q // len(heads.kv)  # local q heads per local KV head (HeadShard)
        rows: list[tuple[int, int]] = []
        for i, kv in enumerate(heads.kv):
            first = heads.q[0] + i * per - kv * group  # within its group
            at = kv * (group + 2) * head_dim
            rows += head_ranges(range(first, first + per), head_dim, at)
            rows += head_ranges((group, group + 1), head_dim, at)  # k, v
        return [_merge(rows)]
    width = num_heads * head_dim  # PACKED
    return [_merge([r for part in range(3) for r in head_ranges(q_heads, head_dim, part * width)])]
