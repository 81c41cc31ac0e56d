"""Tensor parallelism on an injected model: shard, wire the collectives, keep ranks in step.

`parallelize(model, report)` runs inside injection (hf_dsinfer.phases) when `tp_size > 1`:
1. plan every block, the embedding and lm_head for this rank (plan.py) and slice the weights in
   place, unless the sharded loader (loading.py) already read only this rank's slices;
2. re-resolve each FusedBlock on its local shards (head counts follow the weight shapes), give it
   the group's all-reduce for its row-parallel outputs and its ALiBi head range;
3. make the embedding vocab-parallel (masked local lookup + one all-reduce) and lm_head
   vocab-parallel (local logits + one all-gather), tied or not;
4. wrap `model.generate` so every rank starts from the group's first rank's RNG state: the
   logits are identical on every rank, so sampling draws the same tokens and every rank stops
   at the same step (no rank leaves the collectives early).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_dsinfer import state
from hf_dsinfer.errors import TensorParallelError
from hf_dsinfer.injection.fused import FusedBlock, _norm_eps, resolve_spec
from hf_dsinfer.injection.layers import iter_layers
from hf_dsinfer.injection.policy import (
    GROUPED_GQA,
    PACKED_GQA,
    QK_NORM_FULL,
    RMS_STYLES,
    Policy,
)
from hf_dsinfer.injection.walker import InjectionReport
from hf_dsinfer.kernels.norms import rms_weight
from hf_dsinfer.parallel.groups import RankGroup, tensor_parallel_group
from hf_dsinfer.parallel.plan import (
    BlockShard,
    linear_styles,
    module_name,
    plan_block,
    vocab_spec,
)
from hf_dsinfer.parallel.slicing import ShardSpec, split_sizes


@dataclasses.dataclass
class ModelPlan:
    """Every parameter this rank keeps a slice of (absent: replicated), by full name."""

    blocks: dict[str, BlockShard]     # block path -> its shard
    params: dict[str, ShardSpec]
    vocab: int
    vocab_sizes: list[int]
    source: str                       # where the column/row split came from
    tied: bool


@dataclasses.dataclass
class TPReport:
    """What tensor parallelism did on this rank; printed by explain."""

    rank: int
    size: int
    ranks: tuple[int, ...]
    plan: ModelPlan
    loaded_sharded: bool

    def describe(self) -> str:
        first = next(iter(self.plan.blocks.values()), None)
        heads = ""
        if first is not None:
            q0, q1 = first.heads.q
            f0, f1 = first.ffn
            mlp = f"MLP [{f0}:{f1}] of {first.ffn_size}" if first.ffn_size else \
                "no dense MLP (MoE experts are not tensor-sliced)"
            heads = (f"; attention heads q[{q0}:{q1}] of {first.num_heads}, kv "
                     f"{list(first.heads.kv)} of {first.num_kv_heads}; {mlp}")
        v0 = sum(self.plan.vocab_sizes[: self.rank])
        v1 = v0 + self.plan.vocab_sizes[self.rank]
        how = "sharded loading (only this rank's slices read)" if self.loaded_sharded else \
            "sliced in place after the parity gate"
        return (f"tensor parallel: rank {self.rank} of {self.size} (global ranks "
                f"{list(self.ranks)}), plan from {self.plan.source}, {how}{heads}; vocab "
                f"[{v0}:{v1}] of {self.plan.vocab} ({'tied' if self.plan.tied else 'untied'} "
                "embedding / lm_head); one all-reduce per row-parallel output "
                "(one per layer for parallel-residual layouts)")


# -- planning ------------------------------------------------------------------------------------
def plan_model(model: nn.Module, policy: Policy, tp: RankGroup) -> ModelPlan:
    """This rank's slices of every block, the embedding and lm_head (full or meta weights)."""

    _, source = linear_styles(policy, model.config)
    blocks, params = {}, {}
    for path, index, block in iter_layers(model, policy):
        if getattr(block, "is_pipeline_placeholder", False):  # held by another pipeline stage
            continue
        shard = plan_block(block, policy, model.config, index, tp.size, tp.rank)
        blocks[path] = shard
        params.update({f"{path}.{name}": spec for name, spec in shard.params.items()})
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = embed.weight.shape[0]
    spec = vocab_spec(vocab, tp.size, tp.rank)
    params[f"{module_name(model, embed)}.weight"] = spec
    tied = head is not None and head.weight is embed.weight
    if head is not None:
        if head.weight.shape[0] != vocab:
            raise TensorParallelError(
                f"lm_head has {head.weight.shape[0]} outputs but the embedding {vocab} rows; "
                "vocab-parallel slicing needs them equal. Fix: use tp_size=1 for this model.")
        name = module_name(model, head)
        params[f"{name}.weight"] = spec
        if getattr(head, "bias", None) is not None:
            params[f"{name}.bias"] = spec
    return ModelPlan(blocks, params, vocab, split_sizes(vocab, tp.size), source, tied)


# -- slicing in place ----------------------------------------------------------------------------
def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter `name` (full dotted name) by `tensor`, keeping it a frozen Parameter."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    _sync_size_attrs(module)


def _sync_size_attrs(module: nn.Module) -> None:
    """Keep nn.Linear / Conv1D size attributes equal to the (local) weight's shape."""
    weight = module._parameters.get("weight")
    if weight is None:
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = weight.shape
    elif type(module).__name__ == "Conv1D":
        module.nx, module.nf = weight.shape


def shard_in_place(model: nn.Module, plan: ModelPlan) -> None:
    named = dict(model.named_parameters(remove_duplicate=False))
    done: dict[int, nn.Parameter] = {}
    for name, spec in plan.params.items():
        old = named[name]
        if id(old) not in done:  # tied weights are sliced once and shared again
            set_parameter(model, name, spec.take(old.detach()))
            done[id(old)] = dict(model.named_parameters(remove_duplicate=False))[name]
        else:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = done[id(old)]


# -- wiring --------------------------------------------------------------------------------------
class VocabParallelEmbedding:
    """Installed as the embedding's `forward`: rows [start, stop) of the vocabulary live here;
    ids outside give zeros and one all-reduce sums the ranks (exactly one rank contributes).
    The lookup is the module class's own forward, so a scaled embedding (Gemma's
    `embed_scale`) keeps its scale."""

    def __init__(self, module: nn.Embedding, start: int, tp: RankGroup):
        self.module, self.start, self.tp = module, start, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        rows = self.module.weight.shape[0]
        inside = (local >= 0) & (local < rows)  # [B, S]
        out = type(self.module).forward(self.module, local.clamp(0, rows - 1))  # [B, S, H]
        return self.tp.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0))


class VocabParallelHead:
    """Installed as lm_head's `forward`: local logits [.., V_local], all-gathered to [.., V]."""

    def __init__(self, module: nn.Module, sizes: list[int], tp: RankGroup):
        self.module, self.sizes, self.tp = module, sizes, tp

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.module.weight, getattr(self.module, "bias", None))
        return self.tp.all_gather_uneven(local, self.sizes)


class FullQKNorm:
    """Installed as FusedBlock.sharded_qk_norm (OLMoE): RMSNorm over the whole q and k
    projections while their heads are spread over the group. Each rank sums the squares of its
    heads (a KV head kept by several ranks counted once), one all-reduce adds q's and k's sums,
    and each rank scales its heads by its slice of the norm weights, in HF's fp32 numerics."""

    def __init__(self, fused: FusedBlock, shard: BlockShard, tp: RankGroup):
        self.norms = (fused._q_norm, fused._k_norm)
        self.eps = tuple(_norm_eps(n) for n in self.norms)
        self.style = RMS_STYLES[fused.spec.norm]  # OLMoE: Llama's numerics; OLMo 2: fp32
        d = fused.spec.head_dim
        self.head_dim = d
        device = fused._q_norm.weight.device
        self.widths = torch.tensor([shard.num_heads * d, shard.num_kv_heads * d],
                                   dtype=torch.float32, device=device)  # full q / k widths
        self.k_owned = torch.tensor(shard.kv_owned, dtype=torch.float32, device=device)  # [KV_l]
        self.tp = tp

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q32, k32 = q.float(), k.float()  # [B, S, heads * D]
        k_heads = k32.pow(2).unflatten(-1, (-1, self.head_dim)).sum(-1)  # [B, S, local KV heads]
        squares = torch.stack([q32.pow(2).sum(-1), (k_heads * self.k_owned).sum(-1)], -1)
        mean = self.tp.all_reduce(squares) / self.widths  # [B, S, 2]
        return tuple(rms_weight(x * torch.rsqrt(mean[..., i:i + 1] + self.eps[i]), norm.weight,
                                t.dtype, self.style)
                     for i, (x, t, norm) in enumerate(zip((q32, k32), (q, k), self.norms)))


class SyncedGenerate:
    """Wraps `model.generate` (hf_dsinfer.phases installs it): every rank starts from the
    group's first rank's RNG state."""

    def __init__(self, generate: Any, tp: RankGroup):
        self.generate, self.tp = generate, tp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sync_rng(self.tp)
        return self.generate(*args, **kwargs)


class RefuseShardedSave:
    """Installed as `model.save_pretrained` of a tensor-parallel model: its parameters are this
    rank's slices, so HF's save would write a checkpoint that no longer matches its config."""

    def __init__(self, tp: RankGroup):
        self.tp = tp

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise TensorParallelError(
            f"save_pretrained on a tensor-parallel model: rank {self.tp.rank} of tp_size="
            f"{self.tp.size} holds only its slices of the weights, so the files written would not "
            "match the config and would load wrong. Fix: save the checkpoint from a tp_size=1 "
            "model (before init_inference); from_pretrained(..., dsinfer={'tp_size': N}) then "
            "reads each rank's slices from that single checkpoint.")


def sync_rng(tp: RankGroup) -> None:
    """Copy the group's first rank's torch RNG state (CPU, and CUDA if used) to every rank."""
    state = tp.broadcast_from_first(torch.get_rng_state().to(tp.device))
    torch.set_rng_state(state.cpu())
    if tp.device.type == "cuda":
        cuda_state = tp.broadcast_from_first(torch.cuda.get_rng_state().to(tp.device))
        torch.cuda.set_rng_state(cuda_state.cpu())


def _wire_blocks(model: nn.Module, report: InjectionReport, plan: ModelPlan, tp: RankGroup) -> None:
    for index, (path, fused) in enumerate(report.blocks.items()):
        fused.bind()
        fused.spec = resolve_spec(fused.block, fused.policy, model.config, index)
        if fused.policy.qkv_layout in (PACKED_GQA, GROUPED_GQA) or fused.mla is not None:
            # the config (MLA: the module's num_heads) counts all heads: the shard's
            heads = plan.blocks[path].heads
            fused.spec = dataclasses.replace(fused.spec, num_heads=heads.num_q,
                                             num_kv_heads=len(heads.kv))
        fused.reduce = tp.all_reduce
        q0, q1 = plan.blocks[path].heads.q
        fused.head_slice = slice(q0, q1)
        if fused.spec.qk_norm == QK_NORM_FULL:
            fused.sharded_qk_norm = FullQKNorm(fused, plan.blocks[path], tp)
        if fused.is_moe:  # experts stay whole; the shared expert (if any) is tensor-sliced
            fused.moe.reduce = tp.all_reduce
        if not fused.enabled:
            raise TensorParallelError(
                f"{path} failed the parity gate and would fall back to the HF forward, which "
                "cannot run on sharded weights. Fix: report the model config; use tp_size=1.")


def _wire_vocab(model: nn.Module, plan: ModelPlan, tp: RankGroup) -> None:
    start = sum(plan.vocab_sizes[: tp.rank])
    embed = model.get_input_embeddings()
    stub = "_dsinfer_pipeline_stub"  # held by another pipeline stage (parallel/pipeline.py)
    if not getattr(embed, stub, False):
        embed.forward = VocabParallelEmbedding(embed, start, tp)
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, stub, False):
        head.forward = VocabParallelHead(head, plan.vocab_sizes, tp)


def parallelize(model: nn.Module, report: InjectionReport) -> TPReport:
    """Shard (unless loaded sharded) and wire an injected model for `report.config.tp_size`."""
    tp = tensor_parallel_group(report.config.tp_size)
    plan = state.get(model, "tp_plan")  # loaded sharded: the weights are already local
    loaded_sharded = plan is not None
    if plan is None:
        plan = plan_model(model, report.policy, tp)
        shard_in_place(model, plan)
    _wire_blocks(model, report, plan, tp)
    _wire_vocab(model, plan, tp)
    model.save_pretrained = RefuseShardedSave(tp)
    return TPReport(tp.rank, tp.size, tp.ranks, plan, loaded_sharded)


def check_tensor_parallel(model: nn.Module, policy: Policy, tp_size: int) -> None:
    """Fail at init, on every rank alike, before anything is touched: no process group, a world
    too small, a plan that does not fit the model (e.g. more ranks than heads)."""
    tp = tensor_parallel_group(tp_size)
    if state.get(model, "tp_plan") is None:
        plan_model(model, policy, tp)
