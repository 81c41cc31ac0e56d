"""The native decode layer of one fused block, described from its modules: what
kernels.decode's C layer reads (the weights where the model keeps them: bf16 nn.Linear, int8
and int4 QuantizedLinear, row slices of fused projections) and the tensors it watches, so a
moved or replaced weight rebuilds it. kernels/ works on tensors; reading modules is here.
`build_decode_layer` raises NativeUnsupported, with the reason, for a layer the kernel does not
compute; the fused block then takes the torch path."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hf_dsinfer.errors import NativeUnsupported
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels.abi import (
    LIN_BF16,
    LIN_INT4,
    LIN_INT4_A8,
    LIN_INT4_A8_TILED,
    LIN_INT4_TILED,
    LIN_INT8,
    LIN_INT8_TILED,
    MLPS,
    MLPS_PLAIN,
    NORMS,
    ROPES,
    SLOTS,
)
from hf_dsinfer.kernels.abi import Layer as _Layer
from hf_dsinfer.kernels.abi import Lin as _Lin
from hf_dsinfer.kernels.decode import DecodeLayer, Watched
from hf_dsinfer.kernels.quant import INT4_GROUP_SIZES, TILE_ROWS

MAX_HEAD_DIM = 256  # accumulators in registers (cpu_decode.c: attend, MAX_D)
MAX_INT4_GROUPS = 1024  # groups per row (cpu_decode.c: MAX_GROUPS)


class RowSlice(NamedTuple):
    """Rows row0 .. row0 + rows of a fused projection's output, as one projection of the layer
    (Phi-3: q, k, v of `qkv_proj`; gate, up of `gate_up_proj`). Read in place, no copy."""

    module: nn.Module
    row0: int
    rows: int


def _dtype_code(t: torch.Tensor, what: str) -> int:
    code = _native.DTYPE_CODES.get(t.dtype)
    if code is None:
        raise NativeUnsupported(f"{what} of dtype {t.dtype}")
    return code


def _linear(module: nn.Module, n: int, k: int, row0: int | None = None) -> tuple[_Lin, Watched]:
    """The C description of one projection [n, k] and where the tensors it reads live: all of
    `module`, or (row0 given) its rows row0 .. row0 + n, one part of a fused projection
    (Phi-3's qkv_proj or gate_up_proj: every per-row array is read from row row0 on)."""
    rows_needed, exact = (n, True) if row0 is None else (row0 + n, False)
    row0 = row0 or 0

    def at(t: torch.Tensor, per_row: int) -> int:  # address of row row0 of a per-row array
        return t.data_ptr() + row0 * per_row * t.element_size()

    buffers = module._buffers
    if isinstance(module, QuantizedLinear):
        qw = module.quantized
        if qw.tiled and (row0 % TILE_ROWS or n % TILE_ROWS):
            raise NativeUnsupported(f"rows {row0}..{row0 + n} of a tiled weight ({TILE_ROWS}-row tiles)")
        if module.bits == 8:
            if qw.rowsum is None or (qw.in_scale is not None
                                     and qw.in_scale.dtype != torch.float32):
                raise NativeUnsupported("int8 weight without row sums or fp32 input scales")
            names = ["qweight", "scales", "rowsum"] + (["in_scale"] if qw.in_scale is not None
                                                      else [])
            kind = LIN_INT8_TILED if qw.tiled else LIN_INT8
            lin = _Lin(kind, n, k, 0, _dtype_code(qw.scales, "int8 scales"), 0,
                       at(qw.qweight, k), at(qw.scales, 1), None,
                       None if qw.in_scale is None else qw.in_scale.data_ptr(),
                       at(qw.rowsum, 1), None)
        else:
            a8 = qw.act_bits == 8
            if a8:  # the numbers of the torch path's kernel (quant.linear_int4_a8_cpu)
                if _native.lib("a8") is None:
                    raise NativeUnsupported(f"W4A8 weights: {_native.why_unavailable('a8')}")
                total = qw.scales.shape[0]  # the torch path's kernel takes it whole
                if total % 16 or (module.bias is not None and module.bias.dtype != torch.bfloat16):
                    raise NativeUnsupported(
                        f"a W4A8 projection of {total} out features (the kernel takes multiples "
                        "of 16, and a bf16 bias)")
            elif _native.lib("int4") is None:
                raise NativeUnsupported(f"int4 weights: {_native.why_unavailable('int4')}")
            if (k % qw.group_size or qw.group_size not in INT4_GROUP_SIZES
                    or k // qw.group_size > MAX_INT4_GROUPS):
                raise NativeUnsupported(f"int4 group size {qw.group_size} for input size {k}")
            if qw.mins.dtype != qw.scales.dtype:
                raise NativeUnsupported("int4 mins and scales of different dtypes")
            names = ["packed", "scales", "mins"]
            if a8:
                kind = LIN_INT4_A8_TILED if qw.tiled else LIN_INT4_A8
            else:
                kind = LIN_INT4_TILED if qw.tiled else LIN_INT4
            groups = k // qw.group_size
            lin = _Lin(kind, n, k, qw.group_size, _dtype_code(qw.scales, "int4 scales"), 0,
                       at(qw.packed, k // 2), at(qw.scales, groups), at(qw.mins, groups), None,
                       None, None)
        total = qw.scales.shape[0]
        if total < rows_needed or (exact and total != n):
            raise NativeUnsupported(f"quantized weight of {qw.scales.shape[0]} rows, not {n}")
        watched = [(buffers, name) for name in names]
    elif type(module) is nn.Linear:
        w = module.weight
        rows_ok = w.shape[0] == n if exact else w.shape[0] >= rows_needed
        if w.dtype != torch.bfloat16 or not rows_ok or w.shape[1] != k or k % 32:
            raise NativeUnsupported(f"linear weight {w.dtype} {tuple(w.shape)} (bf16, input size a "
                              "multiple of 32)")
        lin = _Lin(LIN_BF16, n, k, 0, 0, 0, at(w, k), None, None, None, None, None)
        watched = [(module._parameters, "weight")]
    else:
        raise NativeUnsupported(f"{type(module).__name__} projection")
    bias = getattr(module, "bias", None)
    if bias is not None:
        lin.b_dt = _dtype_code(bias, "bias")
        lin.bias = at(bias, 1)
        watched.append((module._parameters, "bias"))
    return lin, watched


def _head_norms(struct: _Layer, qk_norm: tuple[nn.Module, nn.Module, float, float],
                widths: tuple[int, int]) -> Watched:
    """Point the layer at its q / k RMSNorm weights: bf16 [head_dim] each (per head), or
    [heads * head_dim] / [kv_heads * head_dim] (over the whole projection: `widths`)."""
    q_norm, k_norm, q_eps, k_eps = qk_norm
    for module, width in zip((q_norm, k_norm), widths):
        w = module.weight
        if w.dtype != torch.bfloat16 or tuple(w.shape) != (width,):
            raise NativeUnsupported(f"q/k norm weight {w.dtype} {tuple(w.shape)} (bf16 [{width}])")
    struct.q_norm, struct.k_norm = q_norm.weight.data_ptr(), k_norm.weight.data_ptr()
    struct.q_eps, struct.k_eps = q_eps, k_eps
    return [(q_norm._parameters, "weight"), (k_norm._parameters, "weight")]


def _norm_weight(module: nn.Module | None, hidden: int, norm: str) -> int | None:
    """The address of a norm's bf16 [hidden] weight (None: no norm there, RMS styles only)."""
    if module is None:
        if norm == "layer":
            raise NativeUnsupported("a LayerNorm block without its norm")
        return None
    w = module.weight
    if w.dtype != torch.bfloat16:
        raise NativeUnsupported(f"bf16 models only (weights are {w.dtype})")
    if w.shape != (hidden,):
        raise NativeUnsupported(f"norm weight of shape {tuple(w.shape)}")
    return w.data_ptr()


def _check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    """The kernel rotates pairs (j, j + rotary_dim / 2) of the first rotary_dim dims of a head
    with masked 16-lane loads: any even width from 2 to head_dim. HF's rotate_half of an odd
    width pairs values differently, so an odd one is refused."""
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise NativeUnsupported(f"partial rotary over {rotary_dim} of {head_dim} head dims (the "
                                "kernel rotates an even number of dims, at most head_dim)")


def _options(struct: _Layer, norm: str, post_norms: tuple | None, softcap: float | None,
             window: int | None) -> Watched:
    """The layer's post-norms (sandwich), soft-cap and sliding window into the struct."""
    watched: Watched = []
    if post_norms is not None:  # a residual multiplier then scales each post-norm's output
        if norm == "layer":
            raise NativeUnsupported("LayerNorm post-norms")
        attn_norm, mlp_norm, eps3, eps4 = post_norms
        struct.ln3 = _norm_weight(attn_norm, struct.hidden, norm)
        struct.ln4 = _norm_weight(mlp_norm, struct.hidden, norm)
        struct.eps3, struct.eps4 = eps3, eps4
        watched += [(m._parameters, "weight") for m in (attn_norm, mlp_norm)]
    if softcap is not None:
        if not softcap > 0:
            raise NativeUnsupported(f"an attention soft-cap of {softcap}")
        struct.softcap = softcap
    if window is not None:
        if window < 1:
            raise NativeUnsupported(f"a sliding window of {window}")
        struct.window = window
    return watched


def build_decode_layer(ln1: nn.Module, ln2: nn.Module, eps: tuple[float, float],
          linears: dict[str, nn.Module | RowSlice | None], heads: int, kv_heads: int,
          head_dim: int,
          scale: float, *, norm: str = "rms", rope: bool | str = True, mlp: str = "gated_silu",
          q_scale: float | None = None,
          qk_norm: tuple[nn.Module, nn.Module, float, float] | None = None,
          residual_multiplier: float | None = None, qk_norm_full: bool = False,
          post_norms: tuple[nn.Module, nn.Module, float, float] | None = None,
          softcap: float | None = None, window: int | None = None,
          rotary_dim: int | None = None, qk_norm_after_rope: bool = False) -> DecodeLayer:
    """Raises NativeUnsupported (with the reason) for a layer the kernel does not compute.

    linears: by slot name (abi.SLOTS) q, k, v, o, then gate, up, down (mlp "gated_silu":
    Llama) or gate=fc1, up=None, down=fc2 (mlp "relu": OPT); any of them may be a RowSlice
    of a fused projection (Phi-3). norm "rms" (weight only), "layer" (LayerNorm, weight and optional
    bias), "rms_fp32" (OLMo 2's weight multiply in fp32) or "rms_unit_offset" (Gemma's (1 + w)
    in fp32), for every norm of the layer; ln1 / ln2 None: no pre-norm (OLMo 2, RMS styles);
    rope True / "bf16" (cos / sin bf16), "fp32" (fp32 cos / sin, one rounding: OLMo 2),
    "bf16_pairs" / "fp32_pairs" (interleaved pairs (2j, 2j + 1) rotated by cos / sin [j], the
    first half of Llama's tables: Helium, GLM / ERNIE 4.5) or False / "none": positions enter
    before the layers (OPT's learned embeddings) or none (NoPE);
    mlp "gated_silu", "gated_gelu_tanh" (Gemma's GeGLU), or a plain one (gate=fc1, up=None):
    "relu", "relu2" (Nemotron, Arcee) or "gelu_tanh" (StarCoder2);
    q_scale: q is multiplied by it after its projection, as OPT does, and `scale` applies
    to q . k (1.0 for OPT); qk_norm: (q_norm, k_norm, q eps, k eps), RMSNorms over each
    head's head_dim before RoPE, Llama numerics (Qwen3); residual_multiplier: the
    attention and MLP outputs are multiplied by it (rounded) before each residual add
    (Granite); qk_norm_full: the q / k norms are over the whole projection (OLMo 2), not per
    head; post_norms: (post-attention norm, post-MLP norm, their eps), applied to each branch
    before its residual add (sandwich: Gemma 2/3, OLMo 2), where the residual multiplier
    then scales its output (HyperCLOVA X's Peri-LN); softcap: attention logits
    s -> softcap * tanh(s / softcap) (Gemma 2); window: each query attends only its last
    `window` keys (a sliding-window layer; HF's mask says the same); rotary_dim: only the
    first rotary_dim dims of each q / k head rotate, the rest pass through (partial rotary:
    Phi-3's partial_rotary_factor; None: all head_dim); qk_norm_after_rope: the q / k norms
    apply to the rotated q and k (HunYuan), not before RoPE."""
    lib = _native.lib()
    if lib is None:
        raise NativeUnsupported(f"native kernels unavailable ({_native.why_unavailable()})")
    if head_dim % 32 or head_dim > MAX_HEAD_DIM:
        raise NativeUnsupported(f"head_dim {head_dim} (needs a multiple of 32, at most "
                                f"{MAX_HEAD_DIM})")
    rope = {True: "bf16", False: "none"}.get(rope, rope)
    if heads % kv_heads:
        raise NativeUnsupported(f"{heads} query heads over {kv_heads} kv heads")
    if norm not in NORMS or mlp not in MLPS or rope not in ROPES:
        raise NativeUnsupported(f"norm {norm!r} / MLP {mlp!r} / RoPE {rope!r} (kernels: "
                                f"{sorted(NORMS)} / {sorted(MLPS)} / {sorted(ROPES)})")
    present = [m for m in (ln1, ln2, *(post_norms or ())[:2]) if m is not None]
    if not present:
        raise NativeUnsupported("a layer without norms")
    hidden = present[0].weight.shape[0]
    biases = []
    norm_ptrs = [_norm_weight(module, hidden, norm) for module in (ln1, ln2)]
    for module in (ln1, ln2):
        b = getattr(module, "bias", None) if norm == "layer" else None
        if b is not None and (b.dtype != torch.bfloat16 or b.shape != (hidden,)):
            raise NativeUnsupported(f"norm bias {b.dtype} {tuple(b.shape)}")
        biases.append(b)
    if sorted(linears) != sorted(SLOTS):
        raise ValueError(f"build_decode_layer: linears must name exactly {SLOTS}, got "
                         f"{tuple(linears)}")
    gated = mlp not in MLPS_PLAIN
    if (linears["up"] is None) == gated:
        raise NativeUnsupported(f"MLP {mlp!r} with {'no' if gated else 'an'} up projection")
    gate = linears["gate"]
    inter = gate.rows if isinstance(gate, RowSlice) else getattr(gate, "out_features", None)
    if inter is None:
        raise NativeUnsupported(f"{type(gate).__name__} projection")
    shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden),
              "v": (kv_heads * head_dim, hidden), "o": (hidden, heads * head_dim),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    if rope != "none" and rotary_dim is not None:
        _check_rotary_dim(rotary_dim, head_dim)
    struct = _Layer(hidden, heads, kv_heads, head_dim, inter, eps[0], eps[1], scale,
                    q_scale or 0.0, *norm_ptrs,
                    *(None if b is None else b.data_ptr() for b in biases), NORMS[norm],
                    ROPES[rope], MLPS[mlp])
    if rope != "none" and rotary_dim is not None:
        struct.rotary_dim = rotary_dim
    watched = [(m._parameters, "weight") for m in (ln1, ln2) if m is not None]
    watched += [(m._parameters, "bias") for m, b in zip((ln1, ln2), biases) if b is not None]
    if qk_norm is not None:
        widths = ((heads * head_dim, kv_heads * head_dim) if qk_norm_full
                  else (head_dim, head_dim))
        watched += _head_norms(struct, qk_norm, widths)
        struct.qk_norm_full = int(qk_norm_full)
        struct.qk_norm_after_rope = int(qk_norm_after_rope)
    elif qk_norm_after_rope:
        raise ValueError("build_decode_layer: qk_norm_after_rope without qk_norm")
    watched += _options(struct, norm, post_norms, softcap, window)
    if residual_multiplier is not None:
        if residual_multiplier == 0:
            raise NativeUnsupported("a residual multiplier of 0")
        struct.resid_mult = residual_multiplier
    for i, name in enumerate(SLOTS):
        module, (n, k) = linears[name], shapes[name]
        if module is None:  # fc1 -> relu -> fc2: no up projection (n = 0 rows)
            struct.lin[i] = _Lin(LIN_BF16, 0, 0, 0, 0, 0, None, None, None, None, None, None)
            continue
        row0 = None
        if isinstance(module, RowSlice):
            if module.rows != n:
                raise NativeUnsupported(f"a slice of {module.rows} rows for a [{n}, {k}] projection")
            module, row0 = module.module, module.row0
        struct.lin[i], used = _linear(module, n, k, row0)
        watched += used
    return DecodeLayer(lib, struct, watched)
