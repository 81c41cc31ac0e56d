"""Tensor-parallel plans: which linears are column- / row-parallel, and each rank's slices.

Which linear is split how comes from HF's `config.base_model_tp_plan` where the family has one
(Llama, Mistral, Qwen2, GPT-NeoX) and from our policy's `tp_plan` otherwise (GPT-2, OPT, BLOOM,
GPT-J, and the mixture-of-experts families). Either must be the Megatron layout of the policy's
linears: Q/K/V (or the fused QKV) and FC1 / gate-up column-parallel, the two output projections
row-parallel. The slice *granularity* comes from the policy: query heads (with their KV heads,
see slicing.py), the packed [q|k|v] Conv1D or per-KV-head grouped QKV layouts, the MLP's
intermediate size; the vocabulary for the embedding and lm_head.

Mixture-of-experts families (DeepSpeed-MoE's layout): attention, the dense MLPs of the layers in
between and Qwen2-MoE's shared expert are tensor-sliced; the router stays replicated and the
experts stay whole (expert parallelism shards them, parallel/expert.py). Each block is planned
from the linears it has: a sparse block has no dense MLP, a dense block no shared expert.
OLMoE's q/k RMSNorm over the whole projection gets its weight sliced like q / k, and the rank's
share of the sum of squares (`BlockShard.kv_owned` counts a replicated KV head once).
gpt-oss's attention-sink logits (one per query head) are sliced with their heads. Multi-head
latent attention (DeepSeek-V3) is split by heads too: the query's last projection and kv_b_proj
by their per-head rows, o_proj by its per-head input columns; q_a_proj, kv_a_proj_with_mqa and
their norms feed every head from one latent, so they (and the latent cache) stay whole.

`plan_model` works on a model whose weights are real or on meta (shapes and module attributes
only), so one plan serves in-place sharding and sharded loading alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from hf_dsinfer.errors import TensorParallelError
from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.fused import resolve_spec
from hf_dsinfer.injection.mla import resolve_mla_spec
from hf_dsinfer.parallel.slicing import (
    HeadShard,
    Ranges,
    ShardSpec,
    head_shard,
    qkv_ranges,
    shard_range,
)

COLWISE, ROWWISE = "colwise", "rowwise"
_HF_STYLES = {"colwise": COLWISE, "rowwise": ROWWISE, "local_colwise": COLWISE,
              "local_rowwise": ROWWISE}


def _join(parent: str | None, name: str) -> str:
    return name if not parent else f"{parent}.{name}"


def mlp_parents(policy: P.Policy) -> list[str | None]:
    """Block-relative paths of the modules holding mlp_in / mlp_out linears: the MLP itself
    (dense families, dense layers of MoE families) and the shared expert (Qwen2-MoE)."""
    parents: list[str | None] = [policy.mlp] if policy.mlp_in else []
    if policy.moe is not None and policy.moe.shared_expert is not None:
        parents.append(_join(policy.mlp, policy.moe.shared_expert))
    return parents


def megatron_styles(policy: P.Policy) -> dict[str, str]:
    """The only layout we compute: block-relative linear path -> style (for MoE families the
    union over sparse and dense blocks; never the experts or the router)."""
    styles = {_join(policy.attn, n): COLWISE for n in (*policy.qkv, *mla_colwise(policy))}
    styles[_join(policy.attn, policy.out_proj)] = ROWWISE
    for parent in mlp_parents(policy):
        styles.update({_join(parent, n): COLWISE for n in policy.mlp_in})
        styles[_join(parent, policy.mlp_out)] = ROWWISE
    return styles


def mla_colwise(policy: P.Policy) -> tuple[str, ...]:
    """Multi-head latent attention's per-head projections (split by heads, as q / k / v are):
    the query's last projection (q_b_proj of a low-rank query, else q_proj) and kv_b_proj. The
    down-projections q_a_proj / kv_a_proj_with_mqa and their norms feed every head: replicated."""
    lay = policy.mla
    return () if lay is None else (lay.q_proj, lay.q_b_proj, lay.kv_b_proj)


def hf_block_plan(config: Any) -> dict[str, str] | None:
    """`base_model_tp_plan` entries for decoder-block linears ('layers.*.x.y' -> 'x.y')."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    block = {}
    for key, style in plan.items():
        head, sep, rest = key.partition(".*.")
        if sep and "." not in head:
            block[rest] = _HF_STYLES.get(style, style)
    return block


def linear_styles(policy: P.Policy, config: Any) -> tuple[dict[str, str], str]:
    """(block-relative linear path -> style, where the plan came from); checked against Megatron.
    Plan entries for other modules (HF's expert entries of MoE families) are ignored."""
    source = "policy tp_plan" if policy.tp_plan is not None else "HF base_model_tp_plan"
    plan = policy.tp_plan if policy.tp_plan is not None else hf_block_plan(config)
    want = megatron_styles(policy)
    if plan is None:
        raise TensorParallelError(
            f"no tensor-parallel plan for {policy.family}: its HF config has no "
            "base_model_tp_plan and the policy has no tp_plan. Fix: add tp_plan="
            f"{want} to hf_dsinfer/injection/policies/{policy.family}.py, or use tp_size=1."
        )
    got = {path: plan.get(path) for path in want}
    if got != want:
        raise TensorParallelError(
            f"the {source} of {policy.family} does not split the block linears Megatron-style: "
            f"expected {want}, got {got}. Fix: correct the plan, or use tp_size=1."
        )
    return want, source


@dataclasses.dataclass(frozen=True)
class BlockShard:
    """One block's slices on one rank."""

    heads: HeadShard
    num_heads: int       # full model
    num_kv_heads: int
    ffn: tuple[int, int]  # [start, stop) of the MLP intermediate dim ((0, 0): no dense MLP)
    ffn_size: int
    params: dict[str, ShardSpec]  # block-relative parameter name -> spec (absent: replicated)
    kv_owned: tuple[bool, ...] = ()  # per local KV head: this rank counts it in a sum over heads


def _linear_specs(module: nn.Module, ranges: Ranges, style: str,
                  conv1d: bool) -> dict[str, ShardSpec]:
    """Weight (and bias) specs of one linear. `ranges` index its output (colwise) or input
    (rowwise) features; nn.Linear stores [out, in], Conv1D [in, out]."""
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    specs = {"weight": ShardSpec(out_dim if style == COLWISE else in_dim, ranges)}
    if style == COLWISE and getattr(module, "bias", None) is not None:
        specs["bias"] = ShardSpec(0, ranges)  # a row-parallel bias is added once, after reduce
    return specs


def _head_norm_count(norm: nn.Module) -> int | None:
    """How many heads a q / k norm module has parameters for (None: one set for every head):
    StableLM's ModuleList of per-head norms, Cohere's [heads, head_dim] weight."""
    norms = getattr(norm, "norms", None)
    if isinstance(norms, nn.ModuleList):
        return len(norms)
    weight = getattr(norm, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def plan_block(block: nn.Module, policy: P.Policy, config: Any, index: int, tp: int,
               rank: int) -> BlockShard:
    styles, _ = linear_styles(policy, config)
    styles = {path: style for path, style in styles.items() if _has(block, path)}
    full = resolve_spec(block, policy, config, index)  # full head counts (real or meta weights)
    if tp > 1 and full.qk_norm == P.QK_NORM_MODULE:
        attn = block.get_submodule(policy.attn)
        for name in policy.qk_norm_attrs:
            count = _head_norm_count(attn.get_submodule(name))
            if count is not None:
                raise TensorParallelError(
                    f"{policy.family}: {type(attn.get_submodule(name)).__name__} holds q / k norm "
                    f"parameters per head ({count}), which this plan does not slice with the "
                    "heads. Fix: use tp_size=1 for this model (its config's q / k norms on).")
    heads = head_shard(full.num_heads, full.num_kv_heads, tp, rank)
    if (policy.qkv_layout not in (P.SEPARATE, P.PACKED_GQA, P.GROUPED_GQA)
            and full.num_kv_heads != full.num_heads):
        raise TensorParallelError(f"{policy.family}: a fused QKV layout with GQA is not sliceable")
    d = full.head_dim
    ranges: dict[str, Ranges] = dict(zip(
        (_join(policy.attn, n) for n in policy.qkv),
        qkv_ranges(policy.qkv_layout, heads, full.num_heads, d, full.num_kv_heads)))
    # out_proj reads the concatenated local heads' outputs: input features [q0 * d, q1 * d)
    ranges[_join(policy.attn, policy.out_proj)] = ((heads.q[0] * d, heads.q[1] * d),)
    if policy.mla is not None:
        ranges.update(_mla_ranges(block, policy, config, heads))
    ffn, ffn_size = (0, 0), 0
    for parent in mlp_parents(policy):
        if not _has(block, _join(parent, policy.mlp_in[0])):  # a sparse block's MLP
            continue
        fc1 = block.get_submodule(_join(parent, policy.mlp_in[0]))
        ffn_size = fc1.weight.shape[1 if policy.conv1d else 0]
        packed = policy.gated and len(policy.mlp_in) == 1  # [gate | up] (Phi-3's gate_up_proj)
        ffn_size //= 2 if packed else 1
        ffn = shard_range(ffn_size, tp, rank)
        for name in (*policy.mlp_in, policy.mlp_out):
            ranges[_join(parent, name)] = (ffn,)
        if packed:  # this rank's gate rows, then the same rows of up
            ranges[_join(parent, policy.mlp_in[0])] = (ffn, (ffn[0] + ffn_size, ffn[1] + ffn_size))
    params = {}
    for path, style in styles.items():
        module = block.get_submodule(path)
        for pname, spec in _linear_specs(module, ranges[path], style, policy.conv1d).items():
            params[f"{path}.{pname}"] = spec
    if policy.sinks_attr is not None:  # gpt-oss: one sink logit per query head, sliced with it
        params[_join(policy.attn, policy.sinks_attr)] = ShardSpec(0, (heads.q,))
    owned: tuple[bool, ...] = ()
    if P.resolve(policy.qk_norm, config) == P.QK_NORM_FULL:  # norm weights [heads * d] follow q / k's slices
        params[_join(policy.attn, "q_norm.weight")] = ShardSpec(0, ranges[_qk_path(policy, 0)])
        params[_join(policy.attn, "k_norm.weight")] = ShardSpec(0, ranges[_qk_path(policy, 1)])
        owned = kv_owned(full.num_heads, full.num_kv_heads, tp, rank)
    return BlockShard(heads, full.num_heads, full.num_kv_heads, ffn, ffn_size, params, owned)


def _mla_ranges(block: nn.Module, policy: P.Policy, config: Any,
                heads: HeadShard) -> dict[str, Ranges]:
    """Output rows of the query and kv_b_proj, input columns of o_proj, for this rank's heads of
    a multi-head latent attention (MHA: each rank's q heads are its KV heads). Per head, the query
    is [nope | rope] wide, kv_b_proj's rows [k_nope | v], o_proj's input v_dim."""
    lay, attn = policy.mla, policy.attn
    spec = resolve_mla_spec(block.get_submodule(attn), lay, config)
    q0, q1 = heads.q  # a contiguous run of heads: one range per projection
    q_name = lay.q_b_proj if spec.low_rank_q else lay.q_proj
    widths = {q_name: spec.nope_dim + spec.rope_dim, lay.kv_b_proj: spec.nope_dim + spec.v_dim,
              policy.out_proj: spec.v_dim}
    return {_join(attn, name): ((q0 * w, q1 * w),) for name, w in widths.items()}


def _qk_path(policy: P.Policy, which: int) -> str:
    """Block-relative path of the q (0) or k (1) projection of a SEPARATE q/k/v layout."""
    if policy.qkv_layout != P.SEPARATE:
        raise TensorParallelError(
            f"{policy.family}: a q/k norm over the whole projection needs separate q/k/v "
            f"projections to be sliced, got the {policy.qkv_layout} layout. Fix: use tp_size=1.")
    return _join(policy.attn, policy.qkv[which])


def kv_owned(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[bool, ...]:
    """Per local KV head of `rank`: True where this rank is the one that counts it in a sum over
    all KV heads (a head kept by several ranks, or twice by one, is counted once: by the lowest
    rank holding it, at its first local position)."""
    owner: dict[int, int] = {}
    for r in range(tp):
        for h in head_shard(num_heads, num_kv_heads, tp, r).kv:
            owner.setdefault(h, r)
    mine = head_shard(num_heads, num_kv_heads, tp, rank).kv
    return tuple(owner[h] == rank and h not in mine[:i] for i, h in enumerate(mine))


def _has(block: nn.Module, path: str | None) -> bool:
    try:
        block.get_submodule(path or "")
    except AttributeError:
        return False
    return True


def vocab_spec(vocab: int, tp: int, rank: int) -> ShardSpec:
    return ShardSpec(0, (shard_range(vocab, tp, rank),))


def module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None)
