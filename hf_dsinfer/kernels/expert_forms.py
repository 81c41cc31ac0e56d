"""Experts in another form than transformers' canonical fused layout, computed with HF's ops.

The canonical layout (kernels/moe.py, MixtralExperts and kin) keeps each expert as nn.Linear
weights `gate_up_proj [E, 2I, H]` whose first I rows are the gate, `down_proj [E, H, I]`, no
biases, and `act(gate) * up`. An ExpertForm describes the ways a family departs from it; each
is an option, written once:

    transposed    gate_up_proj [E, H, 2I], down_proj [E, I, H], applied as `x @ W[e]` (gpt-oss)
    interleaved   gate and up alternate along 2I: gate = h[..., 0::2], up = h[..., 1::2]
    biases        gate_up_proj_bias [E, 2I] and down_proj_bias [E, H], added after each GEMM
    clamped SwiGLU  gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)

Numerics are HF's GptOssExperts op by op: each GEMM, its bias add, the clamps, the sigmoid, the
products are separate ops rounded to the activations' dtype; the expert output times its routing
weight is rounded and index-added in ascending expert order, as HF's loop sums. A transposed
GEMM of a few bf16 rows (decode) runs on kernels.matmul_kn's native kernel: the same roundings,
its fp32 sums in another order (a bf16 output may move by one unit in the last place).

form_expert(x [n, H], tensors, e, form) -> [n, H]          one expert on its rows
form_expert_rows(x_sorted [R, H], tensors, offsets [E+1], form) -> [R, H]
    unweighted outputs of expert-sorted rows (rows past offsets[E] are 0): the building block
    expert parallelism calls on the rows it receives
form_expert_mlp(hidden [T, H], tensors, weights [T, k], ids [T, k], form) -> [T, H]
    the routed mixture: one GEMM pair per expert that has rows (idle experts cost nothing)
expert_linear_weights(tensors, e, form) -> ((W_gu [2I, H], b_gu), (W_d [H, I], b_d))
    the expert as two nn.Linear weights and biases, for weight-only quantization
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels.activations import gated_act_ref, resolve_activation
from hf_dsinfer.kernels.linear import linear_cpu
from hf_dsinfer.kernels.matmul_kn import matmul_kn
from hf_dsinfer.kernels.moe import moe_align, traced_expert_rows


@dataclasses.dataclass(frozen=True)
class ExpertForm:
    act: str = "silu"
    transposed: bool = False
    interleaved: bool = False
    swiglu_alpha: float | None = None  # both set: the clamped SwiGLU (act is then unused)
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        if (self.swiglu_alpha is None) != (self.swiglu_limit is None):
            raise ValueError(f"ExpertForm: the clamped SwiGLU needs both alpha and limit, got "
                             f"alpha={self.swiglu_alpha}, limit={self.swiglu_limit}")

    @property
    def canonical(self) -> bool:
        """kernels/moe.py's layout and activation (the biases are separate)."""
        return not self.transposed and not self.interleaved and self.swiglu_alpha is None

    def describe(self) -> str:
        parts = [name for name, on in (("transposed", self.transposed),
                                       ("interleaved gate/up", self.interleaved)) if on]
        if self.swiglu_alpha is not None:
            parts.append(f"clamped SwiGLU (alpha {self.swiglu_alpha}, limit {self.swiglu_limit})")
        return ", ".join(parts) or "canonical"


class ExpertTensors(NamedTuple):
    gate_up: torch.Tensor  # [E, 2I, H], or [E, H, 2I] transposed
    down: torch.Tensor  # [E, H, I], or [E, I, H] transposed
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
                       ) -> torch.Tensor:
    """gpt-oss's gated unit: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    g = clamp(gate, max=limit); HF's op sequence."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(h: torch.Tensor, form: ExpertForm) -> torch.Tensor:
    """[n, 2I] gate-up projection output -> [n, I] gated activation."""
    if form.interleaved:
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if form.swiglu_alpha is not None:
        return clamped_swiglu_ref(gate, up, form.swiglu_alpha, form.swiglu_limit)
    return gated_act_ref(gate, up, resolve_activation(form.act))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             transposed: bool, backend: str | None = None) -> torch.Tensor:
    if transposed:  # `x @ W + b`: the native kernel for decode's bf16 rows (kernels.matmul_kn)
        return matmul_kn(x, weight, bias, backend=backend)
    # the dense linears' CPU kernels (native bf16 GEMV / panel, fp32 GEMMs for many bf16 rows
    # without bf16 dot products), F.linear else; the bias after the rounding, as before
    y = linear_cpu(x, weight) if x.device.type == "cpu" else F.linear(x, weight)
    return y if bias is None else y + bias


def form_expert(x: torch.Tensor, tensors: ExpertTensors, e: int, form: ExpertForm,
                backend: str | None = None) -> torch.Tensor:
    """Expert e on its rows x [n, H] -> [n, H], unweighted."""
    gu_bias = None if tensors.gate_up_bias is None else tensors.gate_up_bias[e]
    dn_bias = None if tensors.down_bias is None else tensors.down_bias[e]
    h = _project(x, tensors.gate_up[e], gu_bias, form.transposed, backend)  # [n, 2I]
    return _project(expert_activation(h, form), tensors.down[e], dn_bias, form.transposed,
                    backend)


def form_expert_rows(x_sorted: torch.Tensor, tensors: ExpertTensors, offsets: torch.Tensor,
                     form: ExpertForm, backend: str | None = None) -> torch.Tensor:
    """Unweighted outputs [R, H] of expert-sorted rows; rows past offsets[E] are 0."""
    if torch.compiler.is_compiling():  # no host read of the offsets (see kernels/moe.py)
        return traced_expert_rows(x_sorted, offsets,
                                  lambda e, x: form_expert(x, tensors, e, form, backend))
    y = torch.zeros_like(x_sorted)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = form_expert(x_sorted[lo:hi], tensors, e, form, backend)
    return y


def form_expert_mlp(hidden: torch.Tensor, tensors: ExpertTensors, weights: torch.Tensor,
                    ids: torch.Tensor, form: ExpertForm, backend: str | None = None
                    ) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]) -> [T, H]: per active expert, its
    rows' output times their routing weights (promoted dtype, rounded to hidden's), index-added
    in ascending expert order (HF's accumulation order)."""
    align = moe_align(ids, tensors.gate_up.shape[0])
    x = hidden.index_select(0, align.token_idx)  # [T*k, H], contiguous per expert
    w_sorted = weights.reshape(-1).index_select(0, align.flat_idx)  # [T*k]
    out = torch.zeros_like(hidden)
    if torch.compiler.is_compiling():
        y = form_expert_rows(x, tensors, align.expert_offsets, form, backend)
        return out.index_add_(0, align.token_idx, (y * w_sorted[:, None]).to(hidden.dtype))
    bounds = align.expert_offsets.tolist()  # one host sync
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y = form_expert(x[lo:hi], tensors, e, form, backend) * w_sorted[lo:hi, None]
            out.index_add_(0, align.token_idx[lo:hi], y.to(hidden.dtype))
    return out


def expert_linear_weights(tensors: ExpertTensors, e: int, form: ExpertForm):
    """((gate-up weight [2I, H], bias [2I] | None), (down weight [H, I], bias [H] | None)) of
    expert e as nn.Linear stores them (the gate-up rows stay in the form's gate/up order)."""
    gu, dn = tensors.gate_up[e], tensors.down[e]
    if form.transposed:
        gu, dn = gu.t().contiguous(), dn.t().contiguous()
    gu_bias = None if tensors.gate_up_bias is None else tensors.gate_up_bias[e]
    dn_bias = None if tensors.down_bias is None else tensors.down_bias[e]
    return (gu, gu_bias), (dn, dn_bias)
