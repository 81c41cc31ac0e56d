"""Expert parallelism for fused MoE blocks: experts sharded across ranks, tokens moved to their
experts and back by all-to-all with per-rank variable split sizes (DeepSpeed-MoE's inference
layout, on torch.distributed: gloo on CPUs, NCCL on GPUs).

Placement (`ExpertPlacement`), for E experts on an expert-parallel group of N ranks:
    N <= E   rank r owns the E / N consecutive experts r*E/N .. (r+1)*E/N - 1 (N must divide E:
             an uneven split would leave the slowest rank with more experts per step, so it is
             refused with the divisors that work);
    N > E    expert slicing: expert e is split along its intermediate dim over the s = N / E
             ranks e*s .. e*s+s-1 (N a multiple of E, I divisible by s). act(gate) * up is
             elementwise in I, so each slice's down projection is a partial sum: every routed
             token goes to all s slices and the s partial outputs are added on return.

One MoE call on every rank of the group (each rank routes its *own* tokens: the dense parts are
data parallel, or tensor parallel inside groups orthogonal to this one):
    route -> one (token, destination rank) pair per rank a token needs, with up to k (local
    expert, weight) entries -> all-to-all of the hidden rows (each token sent once per rank, not
    once per expert) and of the entries (split sizes exchanged first) -> received rows' entries
    sorted by local expert -> grouped expert GEMM -> weighted sum per pair on the expert's rank
    -> all-to-all back (one pre-summed row per pair) -> added up per token (expert slices too).
`ep_node_size` makes that two all-to-alls (`HierarchicalExchange`): inside each node to the peer
with the destination's local index, then between nodes among same-index peers, so each rank
sends node_size + N/node_size messages instead of N and cross-node messages are larger.

With `tp_size` (DeepSpeed-MoE's parallelism-coordinated communication): the world is tiled by
tp * ep ranks; TP groups are consecutive ranks, EP groups hold the ranks with the same TP index
(stride tp), so every EP group holds all experts and each expert is kept by tp ranks. After the
attention all-reduce the ranks of a TP group hold the same tokens, so TP rank j sends only its
share j of them (balanced, tokens % tp != 0 and 1-token decode steps included) through its EP
group's all-to-all, and one all-gather inside the TP group restores every token's MoE output
on every rank: each all-to-all spans ep ranks instead of tp * ep and moves 1/tp of the rows.

Every rank must call every MoE layer the same number of times: generate() is wrapped to pass
`synced_gpus=True`, so ranks whose sequences finished keep stepping (HF feeds them padding)
until all ranks are done. Weights are sliced after the model is loaded on each rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_dsinfer.errors import ExpertParallelError
from hf_dsinfer.injection.moe import FusedMoE
from hf_dsinfer.injection.walker import InjectionReport
from hf_dsinfer.kernels.moe import moe_align
from hf_dsinfer.parallel.groups import (
    RankGroup,
    ensure_world,
    rank_group,
    tensor_parallel_group,
)
from hf_dsinfer.parallel.slicing import shard_range, split_sizes

# ----------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Which experts (or expert slice) rank `rank` of an `ep_size`-rank group holds."""

    num_experts: int
    ep_size: int
    rank: int

    @property
    def slices(self) -> int:  # ranks per expert (expert slicing when > 1)
        return max(1, self.ep_size // self.num_experts)

    @property
    def experts_per_rank(self) -> int:
        return max(1, self.num_experts // self.ep_size)

    def local_experts(self) -> range:
        first = (self.rank // self.slices) * self.experts_per_rank
        return range(first, first + self.experts_per_rank)

    def intermediate_slice(self, intermediate: int) -> slice:
        width = intermediate // self.slices
        j = self.rank % self.slices
        return slice(j * width, (j + 1) * width)

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routed copies of the kept slots of ids [T, k] (ids >= E are dropped slots):
        (slot [C] = t*k + j, destination rank [C], local expert on that rank [C]); with expert
        slicing each slot has `slices` consecutive copies."""
        flat = ids.reshape(-1)
        slot = torch.nonzero(flat < self.num_experts).squeeze(1)  # [C0]
        expert = flat[slot]
        if self.slices == 1:
            return slot, expert // self.experts_per_rank, expert % self.experts_per_rank
        part = torch.arange(self.slices, device=ids.device)
        dest = (expert[:, None] * self.slices + part).reshape(-1)  # [C0 * s]
        return slot.repeat_interleave(self.slices), dest, torch.zeros_like(dest)


def plan_placement(num_experts: int, intermediate: int, ep_size: int, rank: int,
                   where: str = "MoE") -> ExpertPlacement:
    """Validate and build the placement, with the sizes that would work in the error."""
    if ep_size <= num_experts and num_experts % ep_size == 0:
        return ExpertPlacement(num_experts, ep_size, rank)
    if ep_size > num_experts and ep_size % num_experts == 0 \
            and intermediate % (ep_size // num_experts) == 0:
        return ExpertPlacement(num_experts, ep_size, rank)
    fits = [n for n in range(1, 2 * num_experts + 1)
            if (n <= num_experts and num_experts % n == 0)
            or (n > num_experts and n % num_experts == 0 and intermediate % (n // num_experts) == 0)]
    raise ExpertParallelError(
        f"{where}: ep_size={ep_size} does not fit {num_experts} experts of intermediate size "
        f"{intermediate}: expected a divisor of the expert count (whole experts per rank) or a "
        f"multiple of it whose ratio divides the intermediate size (expert slicing). Uneven "
        f"splits are refused: the rank with the most experts would set every step's pace. "
        f"Fix: use ep_size in {fits}.")


# ----------------------------------------------------------------------------------------------
# All-to-all exchanges
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class A2AStats:
    """Bytes this rank sent to other ranks by all-to-all (rows and their metadata); with tp_size,
    the tokens of its share and the TP all-gathers that restore the rest."""

    row_bytes: int = 0
    meta_bytes: int = 0
    tokens: int = 0
    calls: int = 0
    gathers: int = 0
    gather_bytes: int = 0

    def per_token(self) -> float:
        return (self.row_bytes + self.meta_bytes) / max(self.tokens, 1)


class Exchange:
    """One all-to-all of rows keyed by their destination rank inside `group`: `forward` sends
    rows there (sorted by destination, split sizes exchanged once), `backward` returns rows of
    the received layout to where they came from, in the original order."""

    def __init__(self, dest: torch.Tensor, group: RankGroup, stats: A2AStats):
        self.group, self.stats = group, stats
        self.order = torch.argsort(dest, stable=True)  # [R]
        send = torch.bincount(dest, minlength=group.size)  # [N]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group.group)
        self.send, self.recv = send.tolist(), recv.tolist()
        stats.meta_bytes += send.nbytes

    def forward(self, rows: torch.Tensor, meta: bool = False) -> torch.Tensor:
        return self._a2a(rows.index_select(0, self.order), self.recv, self.send, meta)

    def backward(self, rows: torch.Tensor) -> torch.Tensor:
        back = self._a2a(rows, self.send, self.recv, False)
        out = torch.empty_like(back)
        out[self.order] = back
        return out

    def _a2a(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], meta: bool):
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits,
                               group=self.group.group)
        remote = sum(n for i, n in enumerate(in_splits) if i != self.group.rank)
        nbytes = remote * rows[0].nbytes if len(rows) else 0
        if meta or not rows.is_floating_point():
            self.stats.meta_bytes += nbytes
        else:
            self.stats.row_bytes += nbytes
        return out


class HierarchicalExchange:
    """Two exchanges: inside the node to the peer with the destination's local index, then
    across nodes among the peers with that index."""

    def __init__(self, dest: torch.Tensor, intra: RankGroup, inter: RankGroup, stats: A2AStats):
        self.first = Exchange(dest % intra.size, intra, stats)
        self.second = Exchange(self.first.forward(dest) // intra.size, inter, stats)

    def forward(self, rows: torch.Tensor, meta: bool = False) -> torch.Tensor:
        return self.second.forward(self.first.forward(rows, meta), meta)

    def backward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.first.backward(self.second.backward(rows))


# ----------------------------------------------------------------------------------------------
# The expert-parallel MoE call
# ----------------------------------------------------------------------------------------------


class ExpertParallel:
    """Set as `FusedMoE.parallel`: computes the routed experts across the EP group (and, with
    a TP group, only this TP rank's share of the tokens, all-gathered afterwards)."""

    def __init__(self, placement: ExpertPlacement, group: RankGroup,
                 node_groups: tuple[RankGroup, RankGroup] | None, tp: RankGroup | None = None):
        self.placement, self.group, self.node_groups = placement, group, node_groups
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.stats = A2AStats()

    def _exchange(self, dest: torch.Tensor):
        if self.node_groups is None:
            return Exchange(dest, self.group, self.stats)
        return HierarchicalExchange(dest, *self.node_groups, self.stats)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                expert_rows: Any) -> torch.Tensor:
        """x [T, H], routing [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) [T, H].
        Under tensor parallelism x is the same on every TP rank: each computes its share."""
        if self.tp is None:
            return self.dispatch(x, weights, ids, expert_rows)
        share = slice(*shard_range(x.shape[0], self.tp.size, self.tp.rank))
        y = self.dispatch(x[share], weights[share], ids[share], expert_rows)  # [T_share, H]
        self.stats.gathers += 1
        self.stats.gather_bytes += y.nbytes * (self.tp.size - 1)
        return self.tp.all_gather_uneven(y, split_sizes(x.shape[0], self.tp.size), dim=0)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 expert_rows: Any) -> torch.Tensor:
        """The EP all-to-all round trip for this rank's tokens x [T, H] (T may be 0)."""
        pairs = route_pairs(self.placement, ids, weights)
        exchange = self._exchange(pairs.dest)
        rows = exchange.forward(x.index_select(0, pairs.token))  # [R, H]
        entries = exchange.forward(pairs.entries(), meta=True)  # [R, 2k]
        local, w = unpack_entries(entries, weights.dtype)  # [R, k], [R, k]
        y = exchange.backward(self._weighted_experts(rows, local, w, expert_rows))  # [P, H]
        out = x.new_zeros(x.shape)
        out.index_add_(0, pairs.token, y)  # a token's partial sums from its ranks (and slices)
        self.stats.tokens += ids.shape[0]
        self.stats.calls += 1
        return out

    def _weighted_experts(self, rows: torch.Tensor, local: torch.Tensor, w: torch.Tensor,
                          expert_rows: Any) -> torch.Tensor:
        """Received rows [R, H] with their entries local [R, k] (E_local = unused) and weights
        [R, k] -> sum_j w[r, j] * expert_{local[r, j]}(rows[r]) [R, H], each contribution
        rounded to the rows' dtype as HF rounds it (unused entries add an exact zero)."""
        r, k = local.shape
        align = moe_align(local, self.placement.experts_per_rank)
        used = align.token_idx[: int(align.expert_offsets[-1])]
        y_sorted = expert_rows(rows.index_select(0, used), align.expert_offsets)
        per_entry = rows.new_zeros(r * k, rows.shape[-1])
        per_entry[align.flat_idx[: len(used)]] = y_sorted
        return (per_entry.view(r, k, rows.shape[-1]) * w[..., None]).to(rows.dtype).sum(dim=1)


@dataclasses.dataclass(frozen=True)
class PairRoute:
    """One entry per (token, destination rank) pair, sorted by token then rank: what a token
    sends to a rank once, whatever the number of that rank's experts it picked."""

    token: torch.Tensor   # [P]
    dest: torch.Tensor    # [P]
    local: torch.Tensor   # [P, k] local expert ids on dest (experts_per_rank: unused entry)
    weight: torch.Tensor  # [P, k] routing weights (0 where unused)

    def entries(self) -> torch.Tensor:
        """[P, 2k] fp32: the local ids (small integers, exact in fp32), then the weights (fp32
        or bf16 routing weights, exact in fp32): one all-to-all carries both."""
        return torch.cat([self.local.float(), self.weight.float()], dim=1)


def unpack_entries(entries: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = entries.shape[1] // 2
    return entries[:, :k].long(), entries[:, k:].to(dtype)


def route_pairs(placement: ExpertPlacement, ids: torch.Tensor, weights: torch.Tensor
                ) -> PairRoute:
    """Group the routed copies of ids / weights [T, k] by (token, destination rank)."""
    k = ids.shape[1]
    slot, dest, local = placement.route(ids)  # per routed copy
    key = (slot // k) * placement.ep_size + dest
    pair_key, pair = torch.unique(key, return_inverse=True)  # [P], copy -> its pair
    table = torch.full((len(pair_key), k), placement.experts_per_rank, dtype=torch.long,
                       device=ids.device)
    table[pair, slot % k] = local
    weight = weights.new_zeros(len(pair_key), k)
    weight[pair, slot % k] = weights.reshape(-1)[slot]
    return PairRoute(pair_key // placement.ep_size, pair_key % placement.ep_size, table, weight)


def a2a_bytes_per_token(placement: ExpertPlacement, ids: torch.Tensor, hidden: int,
                        elem_bytes: int, node_size: int | None = None) -> tuple[float, float]:
    """(bytes per token our dispatch + combine send to other ranks, the minimum) for routing
    `ids` [T, k] on rank `placement.rank`, without any process group: one row out and one
    pre-summed row back per (token, rank) pair, the pair's k fp32 (local expert, weight)
    entries, and the split-size vectors. The minimum sends each token's row once to every
    other rank holding one of its experts, and one pre-summed row back."""
    t, k = ids.shape
    pairs = route_pairs(placement, ids, torch.ones(ids.shape))
    me, n = placement.rank, placement.ep_size
    row = hidden * elem_bytes
    hops = _hops(pairs.dest, me, node_size)
    ours = hops * (2 * row + 2 * k * 4) + 8 * n * (1 if node_size is None else 2)
    remote_pairs = int((pairs.dest != me).sum())
    return ours / t, 2 * row * remote_pairs / t


def _hops(dest: torch.Tensor, me: int, node_size: int | None) -> int:
    """Row transfers between distinct ranks for these destinations (flat: one per remote row;
    hierarchical: one per row leaving its node peer, plus one per row crossing nodes)."""
    if node_size is None:
        return int((dest != me).sum())
    first = int((dest % node_size != me % node_size).sum())
    second = int((dest // node_size != me // node_size).sum())
    return first + second


# ----------------------------------------------------------------------------------------------
# Setting it up on a model
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EPReport:
    rank: int
    size: int
    ranks: tuple[int, ...]
    placement: ExpertPlacement
    node_size: int | None
    moes: dict[str, Any]
    tp_ranks: tuple[int, ...] = ()  # the TP group sharing tokens (coordinated all-to-all)

    def describe(self) -> str:
        p = self.placement
        held = (f"experts {p.local_experts().start}..{p.local_experts().stop - 1}"
                if p.slices == 1 else f"1/{p.slices} slice of expert {p.local_experts().start}")
        a2a = "flat" if self.node_size is None else f"hierarchical ({self.node_size} ranks/node)"
        sent = sum(m.parallel.stats.per_token() for m in self.moes.values())
        coordinated = "" if len(self.tp_ranks) < 2 else (
            f"; parallelism-coordinated with the ranks holding the same tokens "
            f"{self.tp_ranks} (the TP group, or the pipeline stage): 1/{len(self.tp_ranks)} "
            "of the tokens through the all-to-all, then an all-gather in that group")
        return (f"expert parallel: rank {self.rank}/{self.size} (global ranks {self.ranks}) holds "
                f"{held}; {a2a} all-to-all, {sent:.0f} bytes sent per token so far{coordinated}")


def check_expert_parallel(report: InjectionReport, config: Any) -> None:
    """Fail at init, on every rank alike, before the model is touched."""
    if not report.moe:
        raise ExpertParallelError(
            f"ep_size={config.ep_size}: {report.model_class} has no mixture-of-experts blocks to "
            "shard. Fix: use ep_size=1, or tp_size for dense models.")
    for path, moe in report.moe.items():
        _refuse_form_slicing(moe, plan_placement(moe.spec.num_experts, moe.spec.intermediate,
                                                 config.ep_size, 0, path))
    check_world(config.ep_size, config.tp_size)
    expert_groups(config.ep_size, config.tp_size, config.ep_node_size)


def check_world(ep_size: int, tp_size: int) -> None:
    """ep_size * tp_size ranks hold one model replica; the world must be a whole number of them
    (checked on every rank alike, before the expert-parallel groups are made)."""
    world = ensure_world(f"ep_size={ep_size}")
    replica = ep_size * tp_size
    if world % replica:
        fits = [e for e in range(1, world // tp_size + 1) if world % (e * tp_size) == 0]
        raise ExpertParallelError(
            f"ep_size={ep_size} x tp_size={tp_size} = {replica} ranks per model replica must "
            f"divide the world of {world} process(es), got world % {replica} = "
            f"{world % replica}. Fix: launch {replica} processes (torchrun --nproc-per-node "
            f"{replica}) or a multiple, or with tp_size={tp_size} use ep_size in {fits}.")


_NODE_GROUPS: dict[tuple[int, int, int], tuple[RankGroup, RankGroup]] = {}


def expert_groups(ep_size: int, tp_size: int, node_size: int | None):
    """(EP group, (intra-node, inter-node) groups or None). EP groups are orthogonal to the
    tensor-parallel groups: ranks with the same TP index (stride tp_size)."""
    ep = rank_group(ep_size, tp_size, f"ep_size={ep_size}")
    if node_size is None:
        return ep, None
    key = (ep_size, tp_size, node_size)
    if key not in _NODE_GROUPS:
        _NODE_GROUPS[key] = _build_node_groups(ep, node_size)
    return ep, _NODE_GROUPS[key]


def _build_node_groups(ep: RankGroup, node: int) -> tuple[RankGroup, RankGroup]:
    """Every rank creates every EP group's node groups, in the same order (new_group is a
    collective over the world)."""
    world, stride = dist.get_world_size(), _stride(ep)
    mine: dict[str, RankGroup] = {}
    for block in range(0, world, ep.size * stride):
        for j in range(stride):
            ranks = [block + j + i * stride for i in range(ep.size)]
            parts = {"intra": [ranks[n:n + node] for n in range(0, ep.size, node)],
                     "inter": [ranks[i::node] for i in range(node)]}
            for kind, groups in parts.items():
                for members in groups:
                    group = dist.new_group(members)
                    if ep.ranks[ep.rank] in members:
                        me = members.index(ep.ranks[ep.rank])
                        mine[kind] = RankGroup(group, me, len(members), tuple(members), ep.device)
    return mine["intra"], mine["inter"]


def _stride(ep: RankGroup) -> int:
    return ep.ranks[1] - ep.ranks[0] if ep.size > 1 else 1


def shard_experts(moe: FusedMoE, placement: ExpertPlacement) -> None:
    """Keep only this rank's experts (or expert slice) as the module's parameters."""
    experts = moe.experts
    local = placement.local_experts()
    if not moe.spec.canonical:
        _shard_form_experts(moe, placement)
        return
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data  # [E, 2I, H], [E, H, I]
    inter = gate_up.shape[1] // 2
    cols = placement.intermediate_slice(inter)
    gate = gate_up[local.start:local.stop, cols]
    up = gate_up[local.start:local.stop, inter + cols.start:inter + cols.stop]
    experts.gate_up_proj = nn.Parameter(torch.cat([gate, up], 1).contiguous(),
                                        requires_grad=False)  # [E_local, 2I/s, H]
    experts.down_proj = nn.Parameter(down[local.start:local.stop, :, cols].contiguous(),
                                     requires_grad=False)  # [E_local, H, I/s]


def _shard_form_experts(moe: FusedMoE, placement: ExpertPlacement) -> None:
    """Experts in another form (kernels.expert_forms: transposed, biased, ...): whole experts
    per rank, every tensor (biases included) cut along the expert dim. Expert slicing would add
    the down-projection bias once per slice: refused."""
    _refuse_form_slicing(moe, placement)
    local = placement.local_experts()
    names = ["gate_up_proj", "down_proj"] + (
        ["gate_up_proj_bias", "down_proj_bias"] if moe.spec.expert_bias else [])
    for name in names:
        full = getattr(moe.experts, name).data
        setattr(moe.experts, name, nn.Parameter(full[local.start:local.stop].contiguous(),
                                                requires_grad=False))


def _refuse_form_slicing(moe: FusedMoE, placement: ExpertPlacement) -> None:
    if placement.slices > 1 and not moe.spec.canonical:
        raise ExpertParallelError(
            f"ep_size={placement.ep_size} slices each of the {placement.num_experts} experts, "
            f"but these experts ({moe.spec.form.describe()}, biased={moe.spec.expert_bias}) are "
            "only sharded whole. Fix: use an ep_size that divides the expert count.")


class SyncedExpertGenerate:
    """Wraps `model.generate` (hf_dsinfer.phases installs it): `synced_gpus=True` unless given,
    so ranks whose sequences
    finished keep joining every MoE all-to-all until all ranks are done."""

    def __init__(self, generate: Any):
        self.generate = generate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("synced_gpus", True)
        return self.generate(*args, **kwargs)


def token_sharing_group(report: InjectionReport) -> RankGroup:
    """The ranks that hold the same tokens and share them out through the all-to-all: the
    tensor-parallel group; in a pipeline, the whole stage (its tp_size * ep_size ranks run one
    schedule on the same micro-batches)."""
    if report.pp is not None:  # stage k: ranks [k * width, (k + 1) * width)
        width = report.pp.ranks.width
        return rank_group(width, 1, f"the pipeline stage of {width} ranks")
    return tensor_parallel_group(report.config.tp_size)


def parallelize_experts(model: nn.Module, report: InjectionReport) -> EPReport:
    """Shard every fused MoE's experts over the EP group and route its tokens by all-to-all."""
    cfg = report.config
    ep, nodes = expert_groups(cfg.ep_size, cfg.tp_size, cfg.ep_node_size)
    tp = token_sharing_group(report)
    placement = None
    for path, moe in report.moe.items():
        if not moe.enabled:
            raise ExpertParallelError(
                f"{path} failed the parity gate and would fall back to the HF forward, which "
                "cannot run on sharded experts. Fix: report the model config; use ep_size=1.")
        placement = plan_placement(moe.spec.num_experts, moe.spec.intermediate, ep.size,
                                   ep.rank, path)
        shard_experts(moe, placement)
        moe.parallel = ExpertParallel(placement, ep, nodes, tp)
    return EPReport(ep.rank, ep.size, ep.ranks, placement, cfg.ep_node_size, report.moe,
                    tp.ranks)


__all__ = ["ExpertParallel", "ExpertParallelError", "ExpertPlacement", "a2a_bytes_per_token",
           "check_expert_parallel", "parallelize_experts", "plan_placement"]
