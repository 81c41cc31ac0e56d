"""Tensor-parallel plans: which linears are column- / row-parallel, and each rank's slices.

Which linear is split how comes from HF's `config.base_model_tp_plan` where the family has one
(Llama, Mistral, Qwen2, GPT-NeoX) and from our policy's `tp_plan` otherwise (GPT-2, OPT, BLOOM,
GPT-J). Either must be the Megatron layout of the policy's linears: Q/K/V (or the fused QKV) and
FC1 / gate-up column-parallel, the two output projections row-parallel. The slice *granularity*
comes from the policy: query heads (with their KV heads, see slicing.py), the packed [q|k|v]
Conv1D or head-interleaved QKV layouts, the MLP's intermediate size; the vocabulary for the
embedding and lm_head.

`plan_model` works on a model whose weights are real or on meta (shapes and module attributes
only), so one plan serves in-place sharding and sharded loading alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.fused import resolve_spec
from hf_dsinfer.parallel.groups import TensorParallelError
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


def megatron_styles(policy: P.Policy) -> dict[str, str]:
    """The only layout we compute: block-relative linear path -> style."""
    styles = {_join(policy.attn, n): COLWISE for n in policy.qkv}
    styles[_join(policy.attn, policy.out_proj)] = ROWWISE
    styles.update({_join(policy.mlp, n): COLWISE for n in policy.mlp_in})
    styles[_join(policy.mlp, policy.mlp_out)] = ROWWISE
    return styles


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
    """(block-relative linear path -> style, where the plan came from); checked against Megatron."""
    if getattr(policy, "moe", None) is not None:
        raise TensorParallelError(
            f"tp_size > 1 is not supported for the mixture-of-experts family {policy.family} "
            "yet (its experts and q/k norms have no tensor-parallel plan). Fix: use tp_size=1, "
            "with expert parallelism for the experts.")
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
    ffn: tuple[int, int]  # [start, stop) of the MLP intermediate dim
    ffn_size: int
    params: dict[str, ShardSpec]  # block-relative parameter name -> spec (absent: replicated)


def _linear_specs(module: nn.Module, ranges: Ranges, style: str,
                  conv1d: bool) -> dict[str, ShardSpec]:
    """Weight (and bias) specs of one linear. `ranges` index its output (colwise) or input
    (rowwise) features; nn.Linear stores [out, in], Conv1D [in, out]."""
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    specs = {"weight": ShardSpec(out_dim if style == COLWISE else in_dim, ranges)}
    if style == COLWISE and getattr(module, "bias", None) is not None:
        specs["bias"] = ShardSpec(0, ranges)  # a row-parallel bias is added once, after reduce
    return specs


def plan_block(block: nn.Module, policy: P.Policy, config: Any, index: int, tp: int,
               rank: int) -> BlockShard:
    styles, _ = linear_styles(policy, config)
    full = resolve_spec(block, policy, config, index)  # full head counts (real or meta weights)
    heads = head_shard(full.num_heads, full.num_kv_heads, tp, rank)
    if policy.qkv_layout != P.SEPARATE and full.num_kv_heads != full.num_heads:
        raise TensorParallelError(f"{policy.family}: a fused QKV layout with GQA is not sliceable")
    mlp = block if not policy.mlp else block.get_submodule(policy.mlp)
    fc1 = mlp.get_submodule(policy.mlp_in[0])
    ffn_size = fc1.weight.shape[1 if policy.conv1d else 0]
    ffn = shard_range(ffn_size, tp, rank)
    d = full.head_dim
    ranges: dict[str, Ranges] = dict(zip((_join(policy.attn, n) for n in policy.qkv),
                                         qkv_ranges(policy.qkv_layout, heads, full.num_heads, d)))
    # out_proj reads the concatenated local heads' outputs: input features [q0 * d, q1 * d)
    ranges[_join(policy.attn, policy.out_proj)] = ((heads.q[0] * d, heads.q[1] * d),)
    for name in (*policy.mlp_in, policy.mlp_out):
        ranges[_join(policy.mlp, name)] = (ffn,)
    params = {}
    for path, style in styles.items():
        module = block.get_submodule(path)
        for pname, spec in _linear_specs(module, ranges[path], style, policy.conv1d).items():
            params[f"{path}.{pname}"] = spec
    return BlockShard(heads, full.num_heads, full.num_kv_heads, ffn, ffn_size, params)


def vocab_spec(vocab: int, tp: int, rank: int) -> ShardSpec:
    return ShardSpec(0, (shard_range(vocab, tp, rank),))


def module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None)
