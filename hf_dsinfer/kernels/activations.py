"""Bias + activation and gated activations (SwiGLU / GeGLU), fused.

bias_act(x, bias, act)   act(x + bias): the epilogue of an MLP's up projection (GPT-2, BLOOM,
                         OPT, GPT-NeoX...). x [..., C], bias [C] or None.
gated_act(gate, up, act) act(gate) * up: the gated MLP of Llama / Mistral (SwiGLU, act="silu")
                         and Gemma / T5 v1.1 (GeGLU, act="gelu" or "gelu_tanh"). gate, up
                         [..., I]; or up=None and gate packed [..., 2*I] as [gate | up], the
                         layout of a fused gate_up projection.

Activations (our names; `resolve_activation` maps Hugging Face config names onto them):
    gelu        0.5 * x * (1 + erf(x / sqrt(2)))                      (F.gelu)
    gelu_tanh   0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (F.gelu(approximate="tanh"))
    relu        max(x, 0)
    silu        x * sigmoid(x)
    relu2       max(x, 0)^2                                          (Primer's squared ReLU:
                                                                      Nemotron, Arcee AFM)

Numerics: every eager op rounds to the input dtype; torch evaluates each activation internally
in fp32 and rounds once. The kernels do the same: the bias add is rounded to x's dtype, the
activation is evaluated in fp32 and rounded once, and in gated_act the product act(gate) * up
is rounded again, so results match the eager chain to within one rounding of the activation.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "relu2")

# Hugging Face `hidden_act` / `activation_function` names -> ours.
_HF_NAMES = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "bloom_gelu": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
    "silu": "silu",
    "swish": "silu",
}

# Activation codes passed to the kernels as a constexpr.
_ACT_CODE = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3, "relu2": 4}


def resolve_activation(hf_name: str) -> str:
    """Map a Hugging Face activation name (config.hidden_act etc.) to one of ACTIVATIONS."""
    if hf_name not in _HF_NAMES:
        raise ValueError(
            f"activation: expected one of {sorted(_HF_NAMES)}, got {hf_name!r}. "
            "Fix: use a model whose hidden_act is one of those, or inject with strict=False so "
            "the MLP keeps running Hugging Face's own activation."
        )
    return _HF_NAMES[hf_name]


def _check_act(act: str) -> str:
    if act not in _ACT_CODE:
        raise ValueError(
            f"activation: expected one of {ACTIVATIONS}, got {act!r}. "
            "Fix: map Hugging Face names with resolve_activation() first."
        )
    return act


def _act_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "relu":
        return F.relu(x)
    if act == "relu2":  # HF's ReLUSquaredActivation: relu (exact), then one rounded square
        return torch.square(F.relu(x))
    return F.silu(x)


def bias_act_ref(x, bias, act, inplace=False):
    """act(x + bias) with eager torch ops (the bias add rounds to x's dtype, as in HF). With
    `inplace` (x is the caller's temporary) the bias add and ReLU / SiLU overwrite x: the same
    values without two fresh tensors, whose page faults cost more than the ops themselves on
    a prefill's [tokens, 4 x hidden] activations (measured: docs/performance.md, "Behind the code")."""
    act = _check_act(act)
    if not inplace or (x.requires_grad and torch.is_grad_enabled()) or (
            bias is not None and torch.promote_types(x.dtype, bias.dtype) != x.dtype):
        return _act_ref(x if bias is None else x + bias, act)
    if bias is not None:
        x.add_(bias)
    if act == "relu":
        return torch.relu_(x)
    if act == "silu":
        return F.silu(x, inplace=True)
    return _act_ref(x, act)


def _split_packed(gate: torch.Tensor, up: torch.Tensor | None):
    """[..., 2*I] packed [gate | up] -> (gate [..., I], up [..., I]) views."""
    if up is not None:
        return gate, up
    if gate.shape[-1] % 2:
        raise ValueError(
            f"gated_act: a packed gate_up tensor needs an even last dim, got {gate.shape[-1]}. "
            "Fix: pass gate and up separately."
        )
    return gate.chunk(2, dim=-1)


def gated_act_ref(gate, up, act):
    """act(gate) * up with eager torch ops, as LlamaMLP: `act_fn(gate_proj(x)) * up_proj(x)`."""
    gate, up = _split_packed(gate, up)
    return _act_ref(gate, _check_act(act)) * up


# ----------------------------------------------------------------------------- Triton kernels


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and define its kernel (once per process)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _act_kernel(X, BIAS, U, OUT, cols, stride_x, stride_u, HAS_BIAS: tl.constexpr,
                    GATED: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        # grid (rows, cdiv(cols, BLOCK)); OUT contiguous [rows, cols]; X (the gate when GATED)
        # and U rows may be strided (halves of a packed gate_up). One kernel for both ops, so
        # the activation is written once.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < cols
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
        if HAS_BIAS:  # the add rounds to the output dtype, as eager's does
            b = tl.load(BIAS + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + b.to(tl.float32)).to(OUT.dtype.element_ty)
        x = x.to(tl.float32)
        if ACT == 0:  # erf GELU
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        elif ACT == 1:  # tanh GELU: 0.5 * x * (1 + tanh(z)) == x * sigmoid(2z), no tanh needed
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = x * tl.sigmoid(2.0 * z)
        elif ACT == 2:
            y = tl.maximum(x, 0.0)
        elif ACT == 4:  # squared ReLU, rounded once as torch.square rounds
            y = tl.maximum(x, 0.0)
            y = y * y
        else:
            y = x * tl.sigmoid(x)
        if GATED:  # eager rounds act(gate) before the product
            u = tl.load(U + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
            y = y.to(OUT.dtype.element_ty).to(tl.float32) * u
        tl.store(OUT + row * cols + offs, y.to(OUT.dtype.element_ty), mask=m)

    return types.SimpleNamespace(cdiv=triton.cdiv, act=_act_kernel)


def _block(cols: int) -> int:
    return min(1024, max(16, 1 << (cols - 1).bit_length()))


def bias_act_triton(x, bias, act, inplace=False):  # writes a new tensor: inplace is moot
    k = _kernels()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [N, C]
    rows, cols = x2.shape
    out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block = _block(cols)
    k.act[(rows, k.cdiv(cols, block))](
        x2, bias.contiguous() if bias is not None else x2, x2, out, cols, cols, 0,
        HAS_BIAS=bias is not None, GATED=False, ACT=_ACT_CODE[_check_act(act)], BLOCK=block,
    )
    return out.view(x.shape)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [N, I] whose last dim is unit-stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gated_act_triton(gate, up, act):
    k = _kernels()
    gate, up = _split_packed(gate, up)
    g2, u2 = _as_rows(gate), _as_rows(up)  # [N, I] each
    rows, inter = g2.shape
    out = torch.empty((rows, inter), dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)
    block = _block(inter)
    k.act[(rows, k.cdiv(inter, block))](
        g2, g2, u2, out, inter, g2.stride(0), u2.stride(0),
        HAS_BIAS=False, GATED=True, ACT=_ACT_CODE[_check_act(act)], BLOCK=block,
    )
    return out.view(*gate.shape)


# No cpu variants: the references already are torch's fused CPU elementwise kernels.


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str, *,
             backend: str | None = None, inplace: bool = False) -> torch.Tensor:
    """act(x + bias) for act in ACTIVATIONS; x [..., C], bias [C] or None. `inplace`: x is a
    temporary the caller gives up, which the eager path may overwrite (see bias_act_ref)."""
    fn = _dispatch.pick(backend, x.device, ref=bias_act_ref, triton_fn=bias_act_triton)
    return fn(x, bias, act, inplace)


def gated_act(gate: torch.Tensor, up: torch.Tensor | None, act: str, *,
              backend: str | None = None) -> torch.Tensor:
    """act(gate) * up; with up=None, gate is packed [..., 2*I] as [gate | up]."""
    fn = _dispatch.pick(backend, gate.device, ref=gated_act_ref, triton_fn=gated_act_triton)
    return fn(gate, up, act)
