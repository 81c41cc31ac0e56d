"""FusedMoE: a transformers sparse-MoE MLP computed with `hf_dsinfer.kernels.moe` ops.

DeepSpeed-MoE's inference recipe on transformers 5's fused 3-D expert tensors: one router GEMM,
fused top-k gating (HF's numerics: softmax in fp32 over all experts, top-k, optional
renormalization, weights cast like the HF router casts them), a dense token->expert table with
rows sorted by expert, a grouped expert GEMM that never touches idle experts, and a weighted
combine. Qwen2-MoE's shared expert (scaled by sigmoid(shared_expert_gate(x))) is added on top.

Like FusedBlock, a FusedMoE is installed as the *instance* `forward` of the HF MoE module, so the
module keeps its class, parameters and names. The enclosing FusedBlock's MLP step calls the
module; when that block runs its HF forward (parity reference, training) the FusedMoE defers to
the HF forward too - unless the experts were quantized or sharded across ranks, which the HF
forward cannot compute: then it raises instead of computing something else.

Routing is dropless (exactly HF) unless `moe_capacity_factor` is set: then each expert keeps at
most ceil(c * T * k / E) routed slots per call, top-1 choices of every token first (GShard's
priority), and the overflow slots are dropped (their weight is not redistributed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_dsinfer.config import QuantConfig
from hf_dsinfer.errors import MoeStateError
from hf_dsinfer.hf.outputs import recording
from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.quantize import QuantizedLinear, quantize_linear, resolve_group_size
from hf_dsinfer.kernels.activations import gated_act, resolve_activation
from hf_dsinfer.kernels.expert_forms import (
    ExpertForm,
    ExpertTensors,
    expert_activation,
    expert_linear_weights,
    form_expert_mlp,
    form_expert_rows,
)
from hf_dsinfer.kernels.linear import linear
from hf_dsinfer.kernels.moe import (
    combine_expert_rows,
    grouped_expert_mlp,
    grouped_expert_rows,
    moe_align,
    topk_gating,
    traced_expert_rows,
)
from hf_dsinfer.kernels.moe_routing import (
    selection_margin,
    sigmoid_group_topk,
    softmax_biased_margin,
    softmax_biased_topk,
    softmax_group_topk,
)

if TYPE_CHECKING:  # annotations only: parallel/ sits above injection
    from hf_dsinfer.parallel.expert import ExpertParallel


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A MoeLayout resolved against one MoE module and its model config."""

    num_experts: int
    top_k: int
    renormalize: bool
    fp32_weights: bool
    activation: str
    hidden: int
    intermediate: int
    capacity_factor: float | None
    shared_expert: bool
    softmax_first: bool = True
    form: ExpertForm = dataclasses.field(default_factory=ExpertForm)
    expert_bias: bool = False
    scoring: str = "softmax"  # or "sigmoid_group" (kernels.moe_routing)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    router_fp32: bool = False
    norm_min: float = 0.0  # softmax_biased: the renormalization's floor

    @property
    def canonical(self) -> bool:
        """Experts kernels.moe computes (else kernels.expert_forms)."""
        return self.form.canonical and not self.expert_bias

    def describe(self) -> str:
        routing = "dropless" if self.capacity_factor is None else f"capacity {self.capacity_factor}"
        shared = " + shared expert" if self.shared_expert else ""
        if self.scoring == "sigmoid_group" and self.n_group > 1:
            routing += (f", sigmoid top-{self.top_k} in {self.topk_group} of {self.n_group} "
                        f"groups, x{self.routed_scaling}")
        elif self.scoring == "sigmoid_group":
            routing += f", sigmoid top-{self.top_k} with a correction bias, x{self.routed_scaling}"
        elif self.scoring == "softmax_group":
            groups = (f" in {self.topk_group} of {self.n_group} groups" if self.n_group > 1
                      else "")
            routing += f", softmax top-{self.top_k}{groups}, x{self.routed_scaling}"
        form = "" if self.canonical else (
            f" ({self.form.describe()}{', biased' if self.expert_bias else ''})")
        return f"{self.num_experts} experts top-{self.top_k}, {routing}{shared}{form}"


def module_attr(module: nn.Module, path: str) -> Any:
    """The attribute at a dotted path under a module (a MoeLayout path: a buffer, a value)."""
    return functools.reduce(getattr, path.split("."), module)


def resolve_moe_spec(module: nn.Module, layout: P.MoeLayout, config: Any, activation: str,
                     capacity_factor: float | None) -> MoeSpec:
    experts = module.get_submodule(layout.experts)
    n_exp, two_inter, hidden = experts.gate_up_proj.shape  # [E, 2I, H]
    if layout.experts_transposed:  # [E, H, 2I]
        hidden, two_inter = two_inter, hidden
    alpha, limit = (P.resolve(v, config) for v in (layout.swiglu_alpha, layout.swiglu_limit))
    form = ExpertForm(act=resolve_activation(activation), transposed=layout.experts_transposed,
                      interleaved=layout.gate_up_interleaved,
                      swiglu_alpha=None if alpha is None else float(alpha),
                      swiglu_limit=None if limit is None else float(limit))
    return MoeSpec(
        num_experts=int(n_exp),
        top_k=int(getattr(config, layout.top_k) if layout.top_k_module is None else
                  module_attr(module, layout.top_k_module)),
        renormalize=bool(P.resolve(layout.renormalize, config)),
        fp32_weights=layout.fp32_weights,
        activation=resolve_activation(activation),
        hidden=int(hidden),
        intermediate=int(two_inter) // 2,
        capacity_factor=capacity_factor,
        shared_expert=layout.shared_expert is not None,
        softmax_first=layout.softmax_first,
        form=form,
        expert_bias=layout.expert_bias,
        **_routing_fields(layout, config),
    )


def _routing_fields(layout: P.MoeLayout, config: Any) -> dict[str, Any]:
    if layout.scoring == "softmax":
        return {}
    if layout.scoring == "softmax_biased":
        return {"scoring": layout.scoring, "router_fp32": layout.router_fp32,
                "norm_min": float(P.resolve(layout.norm_min, config))}
    if layout.scoring not in ("sigmoid_group", "softmax_group"):
        raise ValueError(f"MoeLayout.scoring: expected one of {P.SCORINGS}, got "
                         f"{layout.scoring!r}")
    # DeepSeek-V2's softmax_group takes its groups only where group_limited ("greedy": one)
    grouped = layout.scoring == "sigmoid_group" or bool(P.resolve(layout.group_limited, config))
    return {"scoring": layout.scoring, "router_fp32": layout.router_fp32,
            "n_group": int(P.resolve(layout.n_group, config)) if grouped else 1,
            "topk_group": int(P.resolve(layout.topk_group, config)) if grouped else 1,
            "routed_scaling": float(P.resolve(layout.routed_scaling, config))}


def drop_over_capacity(ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                       factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cap every expert at ceil(factor * T * k / E) slots, top-1 choices first, then top-2, ...
    (tokens in order inside each). Dropped slots get the sentinel id E and weight 0."""
    t, k = ids.shape
    capacity = math.ceil(factor * t * k / num_experts)
    slot_major = ids.t().reshape(-1)  # [k*T]: all top-1 choices, then all top-2 ...
    order = torch.argsort(slot_major, stable=True)
    counts = torch.bincount(slot_major, minlength=num_experts)
    first_row = torch.cumsum(counts, 0) - counts  # [E]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=ids.device)
    position = rank - first_row[slot_major]  # place of each slot inside its expert's queue
    keep = (position < capacity).view(k, t).t()  # [T, k]
    return ids.masked_fill(~keep, num_experts), weights.masked_fill(~keep, 0)


def _linear_any(module: nn.Module, x: torch.Tensor, backend: str,
                with_bias: bool = True) -> torch.Tensor:
    if isinstance(module, QuantizedLinear):
        return module.matmul(x, with_bias)
    return linear(x, module.weight, module.bias if with_bias else None, backend=backend)


class FusedMoE:
    """Callable installed as the HF sparse-MoE module's `forward`; input [B, S, H] or [T, H]."""

    def __init__(self, module: nn.Module, layout: P.MoeLayout, spec: MoeSpec, backend: str,
                 owner: Any):
        self.module = module
        self.layout = layout
        self.spec = spec
        self.backend = backend
        self.owner = owner  # the FusedBlock whose `enabled` flag this follows
        self.calls = 0
        self.hf_forward = type(module).forward.__get__(module)
        self.router = module.get_submodule(layout.router)
        # the Linear holding the router's weight (and bias)
        self.router_linear = (self.router if layout.router_linear is None
                              else self.router.get_submodule(layout.router_linear))
        self.experts = module.get_submodule(layout.experts)
        self.quantized: nn.ModuleList | None = None  # [gate_up_0, down_0, gate_up_1, ...]
        self.parallel: ExpertParallel | None = None  # when ep_size > 1
        # tp_size > 1: sums the tensor-sliced shared expert's partial output over the TP group
        self.reduce: Any = None
        self.margins: list[torch.Tensor] | None = None  # parity probe: routing margins
        # HF's experts implementation when injected; model.set_experts_implementation(other)
        # afterwards hands the experts back to HF's forward (see deferred_why)
        self.experts_implementation = self._experts_implementation()

    @property
    def enabled(self) -> bool:
        return self.owner.enabled

    def _experts_implementation(self) -> str | None:
        return getattr(getattr(self.experts, "config", None), "_experts_implementation", None)

    @property
    def deferred_why(self) -> str | None:
        """Why calls run HF's forward although the block is fused (None: they do not)."""
        now = self._experts_implementation()
        if now != self.experts_implementation:
            return (f"set_experts_implementation({now!r}) after injection (injected with "
                    f"{self.experts_implementation!r}): HF's experts run")
        return None

    # -- entry point ---------------------------------------------------------------------------
    def __call__(self, hidden_states: torch.Tensor) -> Any:
        if not self.enabled or self.module.training or self.deferred_why is not None:
            return self._hf(hidden_states)
        if not torch.compiler.is_compiling():
            self.calls += 1
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        weights, ids = self.route(x)
        out = self.forward_tokens(x, (weights, ids)).view(hidden_states.shape)
        return (out, weights) if self.layout.returns_scores else out  # HF's return value

    def forward_tokens(self, x: torch.Tensor, routed: tuple | None = None) -> torch.Tensor:
        """[T, H] -> [T, H]: routed experts (local or across the EP group) + shared expert."""
        weights, ids = self.route(x) if routed is None else routed
        if self.parallel is not None:
            out = self.parallel.experts(x, weights, ids, self.expert_rows)
        else:
            out = self._local_experts(x, weights, ids)
        if self.spec.shared_expert:
            out = out + self._shared_expert(x)
        return out

    # -- pieces --------------------------------------------------------------------------------
    def correction_bias(self) -> torch.Tensor:
        """The routing's correction bias (layout.correction_bias, a dotted path under the MoE
        module: DeepSeek-V3 keeps it on the router, MiniMax-M2 on the block)."""
        return module_attr(self.module, self.layout.correction_bias)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        # HF computes the router GEMM in the router weight's dtype, the activations' unless a
        # router is kept in fp32 (HunYuan's `wg` is built in fp32; MiniMax-M2 casts x to the
        # weight's dtype too); DeepSeek-V3's in fp32 whatever the weight. The softmax is fp32.
        if self.spec.router_fp32:
            return F.linear(x.float(), self.router_linear.weight.float())  # [T, E]
        weight = self.router_linear.weight
        return F.linear(x.to(weight.dtype), weight,
                        getattr(self.router_linear, "bias", None))  # [T, E]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) exactly as the HF router, then capacity drops."""
        if recording("router_logits"):  # HF's output hooks on the router record its logits
            out = self.router(x, *(module_attr(self.module, a) for a in self.layout.router_args))
            logits = out[0] if isinstance(out, tuple) else out
        else:
            logits = self.router_logits(x)
        if self.spec.scoring == "sigmoid_group":
            weights, ids = sigmoid_group_topk(
                logits, self.correction_bias(), self.spec.top_k,
                self.spec.n_group, self.spec.topk_group, self.spec.renormalize,
                self.spec.routed_scaling)
        elif self.spec.scoring == "softmax_group":  # DeepSeek-V2
            weights, ids = softmax_group_topk(logits, self.spec.top_k, self.spec.n_group,
                                              self.spec.topk_group, self.spec.routed_scaling)
        elif self.spec.scoring == "softmax_biased":  # ERNIE 4.5: weights in x's dtype
            weights, ids = softmax_biased_topk(logits, self.correction_bias(), self.spec.top_k,
                                               self.spec.norm_min)
            weights = weights.to(x.dtype)
        else:
            weights, ids = topk_gating(logits, self.spec.top_k,
                                       softmax_first=self.spec.softmax_first,
                                       renormalize=self.spec.renormalize, backend=self.backend)
        if not self.spec.fp32_weights and self.spec.scoring != "softmax_biased":
            # Qwen2/3-MoE, OLMoE: `router_top_value.to(logits.dtype)`
            weights = weights.to(logits.dtype)
        if self.spec.capacity_factor is not None:
            ids, weights = drop_over_capacity(ids, weights, self.spec.num_experts,
                                              self.spec.capacity_factor)
        return weights, ids

    def expert_rows(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs [R, H] of this rank's experts for expert-sorted rows."""
        if self.quantized is not None:
            return _quantized_rows(x_sorted, self.quantized, offsets, self.spec.form)
        if not self.spec.canonical:
            return form_expert_rows(x_sorted, self.expert_tensors(), offsets, self.spec.form,
                                    self.backend)
        return grouped_expert_rows(x_sorted, self.experts.gate_up_proj, self.experts.down_proj,
                                   offsets, self.spec.activation, backend=self.backend)

    def expert_tensors(self) -> ExpertTensors:
        """The expert parameters as kernels.expert_forms takes them (biases when the layout
        has them)."""
        e = self.experts
        if not self.spec.expert_bias:
            return ExpertTensors(e.gate_up_proj, e.down_proj)
        return ExpertTensors(e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        if (self.quantized is None and self.spec.capacity_factor is None
                and not self.spec.canonical):
            return form_expert_mlp(x, self.expert_tensors(), weights, ids, self.spec.form,
                                   self.backend)
        if self.quantized is None and self.spec.capacity_factor is None:
            return grouped_expert_mlp(x, self.experts.gate_up_proj, self.experts.down_proj,
                                      weights, ids, self.spec.activation, backend=self.backend)
        align = moe_align(ids, self.spec.num_experts)
        rows = self.expert_rows(x.index_select(0, align.token_idx), align.expert_offsets)
        return combine_expert_rows(rows, weights, align)

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x). Under tensor
        parallelism the sliced expert's partial outputs are summed over the group here, and a
        down-projection bias (ERNIE 4.5's use_bias) is added once, after the sum."""
        mlp = self.module.get_submodule(self.layout.shared_expert)
        gate, up = (_linear_any(mlp.get_submodule(n), x, self.backend)
                    for n in self.owner.policy.mlp_in)
        h = gated_act(gate, up, self.spec.activation, backend=self.backend)
        down = mlp.get_submodule(self.owner.policy.mlp_out)
        bias = getattr(down, "bias", None) if self.reduce is not None else None
        out = _linear_any(down, h, self.backend, with_bias=bias is None)
        if self.reduce is not None:
            out = self.reduce(out)
            if bias is not None:
                out = out + bias
        if self.layout.shared_expert_gate is None:  # DeepSeek-V3: added as is
            return out
        gate_linear = self.module.get_submodule(self.layout.shared_expert_gate)
        return torch.sigmoid(_linear_any(gate_linear, x, self.backend)) * out

    def _hf(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None or self.parallel is not None:
            what = "quantized" if self.quantized is not None else "sharded across ranks"
            raise MoeStateError(
                f"{type(self.module).__name__}: the Hugging Face forward was requested (training "
                f"mode, output_attentions, set_experts_implementation after injection, or a "
                f"block that failed the parity gate) but its experts are {what}, which that "
                "forward cannot compute. Fix: call the model in eval mode without "
                "output_attentions and with the experts implementation it was injected with "
                f"({self.experts_implementation!r}), or load it without quant / ep_size.")
        if self.margins is not None:
            self.margins.append(self.routing_margin(hidden_states))
        return self.hf_forward(hidden_states)

    @torch.no_grad()
    def routing_margin(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """p_k - p_(k+1) per token [B, S] of what the router ranks (the fp32 softmax, or the
        logits where the top-k precedes the softmax): how far each token is from swapping its
        k-th expert. The parity gate excludes near-ties, which rounding may legally flip."""
        logits = self.router_logits(hidden_states.reshape(-1, hidden_states.shape[-1]))
        if self.spec.scoring == "sigmoid_group":
            return selection_margin(logits, self.correction_bias(),
                                    self.spec.top_k, self.spec.n_group, self.spec.topk_group
                                    ).view(hidden_states.shape[:-1])
        if self.spec.scoring == "softmax_group":
            return selection_margin(logits, None, self.spec.top_k, self.spec.n_group,
                                    self.spec.topk_group).view(hidden_states.shape[:-1])
        if self.spec.scoring == "softmax_biased":
            return softmax_biased_margin(logits, self.correction_bias(), self.spec.top_k
                                         ).view(hidden_states.shape[:-1])
        probs = torch.softmax(logits.float(), dim=-1) if self.spec.softmax_first else logits.float()
        k = self.spec.top_k
        if k >= probs.shape[-1]:
            return torch.ones(hidden_states.shape[:-1], device=probs.device)
        top = torch.topk(probs, k + 1, dim=-1).values  # [T, k+1]
        return (top[:, k - 1] - top[:, k]).view(hidden_states.shape[:-1])


def _quantized_rows(x_sorted: torch.Tensor, qlinears: nn.ModuleList, offsets: torch.Tensor,
                    form: ExpertForm) -> torch.Tensor:
    """int8 / int4 experts: one weight-only quantized GEMM pair per expert that has rows (torch
    has no grouped int8/int4 GEMM; idle experts still cost nothing). Under torch.compile the
    offsets are not read on the host: every expert runs over all rows and keeps its own (E / k
    times the expert work, but one graph, fullgraph included)."""
    if torch.compiler.is_compiling():
        return traced_expert_rows(x_sorted, offsets, lambda e, x: qlinears[2 * e + 1].matmul(
            _activate(qlinears[2 * e].matmul(x), form)))
    y = torch.zeros_like(x_sorted)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            h = qlinears[2 * e].matmul(x_sorted[lo:hi])  # [n, 2I]
            y[lo:hi] = qlinears[2 * e + 1].matmul(_activate(h, form))
    return y


def _activate(h: torch.Tensor, form: ExpertForm) -> torch.Tensor:
    """[n, 2I] -> [n, I]: the canonical gated activation (kernels.activations), or the form's."""
    return gated_act(h, None, form.act) if form.canonical else expert_activation(h, form)


# -- building, installing, quantizing ------------------------------------------------------------
def build_moe(blocks: dict[str, Any], config: Any, capacity_factor: float | None
              ) -> dict[str, FusedMoE]:
    """A FusedMoE for every fused block whose MLP is a sparse-MoE module: path -> FusedMoE."""
    moes: dict[str, FusedMoE] = {}
    for path, fused in blocks.items():
        if not fused.is_moe:
            continue
        module, layout = fused._mlp_module, fused.policy.moe
        spec = resolve_moe_spec(module, layout, config, fused.spec.activation, capacity_factor)
        fused.moe = moes[f"{path}.{fused.policy.mlp}"] = FusedMoE(module, layout, spec,
                                                                   fused.backend, fused)
    return moes


def install_moe(moes: dict[str, FusedMoE]) -> None:
    for moe in moes.values():
        moe.module.forward = moe


def uninstall_moe(moes: dict[str, FusedMoE]) -> None:
    for moe in moes.values():
        if moe.quantized is not None or moe.parallel is not None:
            raise MoeStateError(
                "cannot revert a model whose MoE experts were quantized or sharded across ranks: "
                "the Hugging Face expert forward cannot run on them. Fix: load the model again.")
    for moe in moes.values():
        if moe.module.__dict__.get("forward") is moe:
            del moe.module.forward


def moe_group_size(moes: dict[str, FusedMoE], quant: QuantConfig) -> int | None:
    """The int4 group size of the experts (must divide H and I); raises with the fix."""
    sizes = [n for m in moes.values() for n in (m.spec.hidden, m.spec.intermediate)]
    return resolve_group_size(quant, sizes) if sizes else None


def quantize_moe(moes: dict[str, FusedMoE], quant: QuantConfig) -> tuple[int, int]:
    """Replace every MoE's fused expert tensors by per-expert int8 / int4 weights (the bf16
    tensors are freed); the shared expert's linears become QuantizedLinears. Returns the bytes
    (before, after) of the expert weights."""
    group = moe_group_size(moes, quant)
    before = after = 0
    for moe in moes.values():
        tensors = moe.expert_tensors()
        before += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        qlinears = nn.ModuleList(
            quantize_linear(_as_linear(w, b), False, quant, group, moe.backend)
            for e in range(tensors.gate_up.shape[0])
            for w, b in expert_linear_weights(tensors, e, moe.spec.form))
        after += sum(t.numel() * t.element_size() for t in qlinears.buffers())
        del moe.experts.gate_up_proj, moe.experts.down_proj
        if moe.spec.expert_bias:  # now inside the QuantizedLinears
            del moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias
        moe.experts.dsinfer_quantized = qlinears
        moe.quantized = qlinears
        if moe.spec.shared_expert:
            _quantize_shared(moe, quant, group)
    return before, after


def _as_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A stand-in for nn.Linear, what quantize_linear reads."""
    holder = nn.Module()
    holder.weight, holder.bias = weight.detach(), None if bias is None else bias.detach()
    return holder


def _quantize_shared(moe: FusedMoE, quant: QuantConfig, group: int | None) -> None:
    mlp = moe.module.get_submodule(moe.layout.shared_expert)
    for name in (*moe.owner.policy.mlp_in, moe.owner.policy.mlp_out):
        setattr(mlp, name, quantize_linear(mlp.get_submodule(name), False, quant, group,
                                           moe.backend))
