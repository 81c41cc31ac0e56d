"""Native one-token decode of a Llama-family or OPT layer (csrc/cpu_decode.c): two calls per
layer, with the model's own HF Cache update between them.

A batch-1 decode step reads every weight once, so it is bound by memory bandwidth, and what
keeps it from that bound on a CPU is the ~60 torch dispatches per layer around the weight reads
(norms, projections, ~20 rotary ops, residuals, attention, the MLP). `DecodeLayer` computes the
layer in two native calls instead:

    attn_in(x, cos, sin)           -> q, k, v    (norm, q/k/v projections + bias, per-head q/k
                                                  norms (Qwen3), RoPE)
    k, v = cache.update(k, v, layer_idx)         (HF's, in Python: any Cache class)
    attn_out(x, q, k, v, keep)     -> out        (attention, o_proj, residual, norm, MLP, residual)

For B > 1 sequences (batched decode, beams, continuous batching's decode rows), attn_in_rows /
attn_out_rows do the same per row (each row its own position and keep mask), or attn_in_rows,
the caller's attention and post_attn_rows. On a CPU with AMX the projections run on its tiles
(hfd_linear_bf16 of csrc/cpu_moe.c for bf16 weights, hfd_int8_amx for int8 row tiles where the
CPU also has AMX-INT8, hfd_int4_amx for 4-bit codes past the int4 kernel's rows), up to 256
rows; without AMX, every projection runs the native kernel the torch path's linear takes for
that many rows (bf16 dot products, the int8 GEMV or panel
kernel, the int4 kernel or panel kernel: csrc/cpu_decode.c's lin_batch, by the tier's
crossovers), and only for the rows where the torch path runs those (`rows_max`). What it does
not take goes to the torch path: `rows_why` says why (measured: docs/performance.md).

It reads the weights where the model keeps them (bf16 nn.Linear, int8 and int4 QuantizedLinear:
injection/native_layer.py describes a block's modules as the C struct and builds the layer) and
rounds to bf16 where HF's bf16 modules round (see the C file's header), so its tokens follow
the torch path's. A layer the kernel does not compute raises NativeUnsupported when it is
described; callers then use the torch path. The calls come from each fused block's forward
(injection/fused.py) or, for a whole step, from one loop over the layers
(injection/decode_step.py).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any

import torch

from hf_dsinfer.errors import NativeUnsupported
from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels.abi import (
    LIN_BF16,
    LIN_INT4,
    LIN_INT4_A8,
    LIN_INT4_A8_TILED,
    LIN_INT4_TILED,
    LIN_INT8,
    LIN_INT8_TILED,
    ROPES,
    ROPES_FP32,
)
from hf_dsinfer.kernels.abi import Layer as _Layer
from hf_dsinfer.kernels.attention import SlotRows

Watched = list[tuple[dict, str]]  # (a dict of tensors, name) per tensor the layer reads
# the rows the batched layer takes on AMX (the torch path's AMX linear: linear.CPU_AMX_MAX_ROWS)
AMX_MAX_ROWS = crossovers.TABLE["amx"].amx_bf16_max_rows


class DecodeLayer:
    """The C description of one layer plus the tensors it points into: kept alive, and checked
    before every call (same tensor objects in their modules, same storage), so that replaced or
    moved weights rebuild it."""

    def __init__(self, lib: ctypes.CDLL, struct: _Layer, watched: Watched):
        self.lib = lib
        self.struct = struct
        self._ref = ctypes.byref(struct)
        for owner, name in watched:
            t = owner[name]
            if t.device.type != "cpu" or not t.is_contiguous():
                raise NativeUnsupported(f"{name} not a contiguous CPU tensor")
        # what current() compares, as parallel tuples it maps over in C. It runs for every
        # layer and token, just after the step streamed the weights through the caches, so its
        # ~23 tensors per layer are mostly cache misses: ~20 us per layer (SmolLM2: 0.6 ms of
        # a 9 ms step), against ~3 us when warm
        self._owners = tuple(owner for owner, _ in watched)
        self._names = tuple(name for _, name in watched)
        self._tensors = tuple(owner[name] for owner, name in watched)
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self.heads, self.kv_heads, self.head_dim = struct.heads, struct.kv_heads, struct.head_dim
        self.hidden = struct.hidden
        self.rope = bool(struct.rope)  # attn_in rotates q and k (needs cos, sin)
        # the dtype of the cos / sin it reads (OLMo 2's and ERNIE 4.5's stay fp32: abi.ROPES)
        self.rope_dtype = (torch.float32 if struct.rope in (ROPES[n] for n in ROPES_FP32)
                           else torch.bfloat16)
        # the width of cos / sin: the leading dims of each head that rotate (partial rotary,
        # Phi-3's partial_rotary_factor: fewer than head_dim; the rest pass through)
        self.rotary_dim = struct.rotary_dim or struct.head_dim
        self.calls = 0  # attn_out calls (one token of one sequence)
        self.row_calls = 0  # attn_out_rows calls (one token of each of several sequences)
        self._amx = bool(lib.hfd_amx_available())  # the batched projections' kernels (C side)
        self._kinds = {_KIND_NAMES[lin.kind] for lin in struct.lin if lin.n}  # their weights
        self._rows_why = _rows_why(lib, struct, self._amx)  # the layer, the CPU: see rows_why

    @property
    def rows_why(self) -> str | None:
        """Why attn_in_rows / attn_out_rows cannot run (None: they can, for 2..rows_max rows).
        HF_DSINFER_NATIVE_AMX=0 and the crossovers are read at every call, as the torch path's
        linears read them."""
        if self._amx:
            if not _native.amx_allowed():
                return f"AMX switched off ({_native.AMX_ENV_VAR}=0)"
            return self._rows_why
        if self._rows_why is not None:
            return self._rows_why
        for kind in sorted(self._kinds):
            if (why := _kind_why(kind)) is not None:
                return why
        if self.rows_max < 2:
            return (f"no AMX, and the {_native.tier()} tier's crossovers give the native "
                    "kernels of these projections no batch")
        return None

    @property
    def rows_max(self) -> int:
        """The most rows attn_in_rows / attn_out_rows take: AMX's 256, else the rows for which
        the torch path's linears run the kernels the batched layer runs for them (the running
        tier's crossovers: bf16_gemm_max_rows, int8_gemm_max_rows, int4_gemm_max_rows, or the
        GEMVs' bounds where the panel kernel does not run), the least over the layer's kinds."""
        if self._amx:  # 4-bit projections: hfd_int4_amx's bound too (the torch path's)
            int4 = crossovers.TABLE["amx"].amx_int4_max_rows if "int4" in self._kinds else None
            return min(AMX_MAX_ROWS, int4 or AMX_MAX_ROWS)
        # never past AMX's bound, which the callers hold to (injection.fused.DECODE_MAX_ROWS)
        return min([AMX_MAX_ROWS, *(_kind_max_rows(kind) for kind in self._kinds)])

    @property
    def rows_kernels(self) -> str:
        """What the batched layer's projections run on, for explain."""
        if self._amx:
            return "AMX"
        return f"the tier's native {' / '.join(sorted(self._kinds))}"

    def current(self) -> bool:
        """The weights are still the tensors (and storage) this description points into."""
        return (all(map(operator.is_, map(dict.get, self._owners, self._names), self._tensors))
                and list(map(torch.Tensor.data_ptr, self._tensors)) == self._ptrs)

    def _cos_sin(self, cos: torch.Tensor | None, sin: torch.Tensor | None, who: str):
        """The pointers of cos / sin (rows of rotary_dim values): required with RoPE, ignored
        (None) without."""
        if not self.rope:
            return None, None
        if cos is None or sin is None:
            raise ValueError(f"{who}: this layer applies RoPE and needs cos and sin")
        if (cos.dtype != self.rope_dtype or sin.dtype != self.rope_dtype
                or not cos.is_contiguous() or not sin.is_contiguous()
                or cos.shape[-1] != self.rotary_dim or sin.shape != cos.shape):
            raise ValueError(f"{who}: cos / sin must be contiguous {self.rope_dtype} rows of "
                             f"{self.rotary_dim} values for this layer, got {cos.dtype} "
                             f"{tuple(cos.shape)} / {sin.dtype} {tuple(sin.shape)}")
        return cos.data_ptr(), sin.data_ptr()

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """x [1, 1, hidden] bf16 -> q [1, heads, 1, d], k, v [1, kv_heads, 1, d] (rotated where
        the layer has RoPE: cos, sin [rotary_dim])."""
        d = self.head_dim
        q = torch.empty(1, self.heads, 1, d, dtype=torch.bfloat16)
        k = torch.empty(1, self.kv_heads, 1, d, dtype=torch.bfloat16)
        v = torch.empty(1, self.kv_heads, 1, d, dtype=torch.bfloat16)
        cos_p, sin_p = self._cos_sin(cos, sin, "attn_in")
        code = self.lib.hfd_decode_attn_in(self._ref, x.data_ptr(), cos_p, sin_p, q.data_ptr(),
                                           k.data_ptr(), v.data_ptr(), torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_attn_in")
        return q, k, v

    def attn_out(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None) -> torch.Tensor:
        """The rest of the layer: k, v [1, kv_heads, Sk, d] from the cache (last dim
        contiguous), or SlotRows over one index (keys left in a paged cache, read through the
        index), keep [Sk] uint8 or None."""
        out = torch.empty_like(x)
        sk = k.shape[2]
        keep_ptr = None if keep is None else keep.data_ptr()
        if isinstance(k, SlotRows):  # slots [S, kv_heads, d]: key j at slots[index[j]]
            if not isinstance(v, SlotRows) or v.index is not k.index:
                raise ValueError("attn_out: keys and values in a paged cache must be SlotRows "
                                 "over one read index")
            ks, vs = k.slots, v.slots
            code = self.lib.hfd_decode_attn_out_slots(
                self._ref, x.data_ptr(), q.data_ptr(), ks.data_ptr(), ks.stride(1), ks.stride(0),
                vs.data_ptr(), vs.stride(1), vs.stride(0), sk, keep_ptr, k.index.data_ptr(),
                out.data_ptr(), torch.get_num_threads())
        else:
            code = self.lib.hfd_decode_attn_out(
                self._ref, x.data_ptr(), q.data_ptr(), k.data_ptr(), k.stride(1), k.stride(2),
                v.data_ptr(), v.stride(1), v.stride(2), sk, keep_ptr, out.data_ptr(),
                torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_attn_out")
        self.calls += 1
        return out

    def step_in(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """attn_in for one sequence, attn_in_rows for several: x [B, 1, hidden] contiguous,
        cos / sin [B or 1, rotary_dim] (None for a layer without RoPE)."""
        if x.shape[0] == 1:
            r = self.rotary_dim
            if cos is not None:
                cos, sin = cos.reshape(r), sin.reshape(r)
            return self.attn_in(x, cos, sin)
        return self.attn_in_rows(x, cos, sin)

    def step_out(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None) -> torch.Tensor:
        """attn_out for one sequence, attn_out_rows for several; keep as keep_rows gives it."""
        if x.shape[0] == 1:
            return self.attn_out(x, q, k, v, None if keep is None else keep.reshape(-1))
        return self.attn_out_rows(x, q, k, v, keep)

    def _check_rows_x(self, x: torch.Tensor, who: str) -> None:
        if (x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != self.hidden
                or x.dtype != torch.bfloat16 or not x.is_contiguous()):
            raise ValueError(f"{who}: x must be contiguous bf16 [B, 1, {self.hidden}], got "
                             f"{x.dtype} {tuple(x.shape)}")

    def attn_in_rows(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """x [B, 1, hidden] bf16 (contiguous), cos / sin [B or 1, rotary_dim] (None without
        RoPE) ->
        q [B, heads, 1, d], k, v [B, kv_heads, 1, d] (rotated): transposed views of
        [B, 1, heads, d] buffers."""
        b, d, r = x.shape[0], self.head_dim, self.rotary_dim
        for name, t in (("cos", cos), ("sin", sin)) if self.rope else ():
            if (t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] != r
                    or t.dtype != self.rope_dtype or not t.is_contiguous()):
                raise ValueError(f"attn_in_rows: {name} must be contiguous {self.rope_dtype} "
                                 f"[1 or {b}, {r}], got {t.dtype} {tuple(t.shape)}")
        self._check_rows_x(x, "attn_in_rows")
        q = torch.empty(b, 1, self.heads, d, dtype=torch.bfloat16)
        k = torch.empty(b, 1, self.kv_heads, d, dtype=torch.bfloat16)
        v = torch.empty(b, 1, self.kv_heads, d, dtype=torch.bfloat16)
        cs_stride = 0 if cos is None or cos.shape[0] == 1 else r
        cos_p, sin_p = self._cos_sin(cos, sin, "attn_in_rows")
        code = self.lib.hfd_decode_attn_in_rows(
            self._ref, b, x.data_ptr(), cos_p, sin_p, cs_stride, q.data_ptr(), k.data_ptr(),
            v.data_ptr(), _bounds(), torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_attn_in_rows")
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attn_out_rows(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      keep: torch.Tensor | None) -> torch.Tensor:
        """The rest of the layer for B rows: x [B, 1, hidden], q as attn_in_rows returned it,
        k, v [B, kv_heads, Sk, d] from the cache (last dim contiguous; see cache_kv_usable),
        keep [B or 1, Sk] uint8 or None."""
        b, sk = x.shape[0], k.shape[2]
        self._check_rows_x(x, "attn_out_rows")
        if (q.shape != (b, self.heads, 1, self.head_dim) or q.dtype != torch.bfloat16
                or not q.transpose(1, 2).is_contiguous()):
            raise ValueError("attn_out_rows: q must be the [B, heads, 1, d] bf16 view "
                             f"attn_in_rows returns, got {q.dtype} {tuple(q.shape)} strides "
                             f"{q.stride()}")
        if not cache_kv_usable(k, v, self.head_dim, b) or k.shape[1] != self.kv_heads:
            raise ValueError(f"attn_out_rows: k, v must be bf16 CPU [{b}, {self.kv_heads}, Sk, "
                             f"{self.head_dim}] with contiguous rows, got {tuple(k.shape)}")
        if keep is not None and (keep.dim() != 2 or keep.shape[0] not in (1, b)
                                 or keep.shape[1] < sk or keep.dtype != torch.uint8
                                 or keep.stride(1) != 1):
            raise ValueError(f"attn_out_rows: keep must be uint8 [1 or {b}, >= {sk}] with "
                             f"contiguous rows, got {keep.dtype} {tuple(keep.shape)}")
        out = torch.empty_like(x)
        keep_stride = 0 if keep is None or keep.shape[0] == 1 else keep.stride(0)
        code = self.lib.hfd_decode_attn_out_rows(
            self._ref, b, x.data_ptr(), q.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1),
            k.stride(2), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), sk,
            None if keep is None else keep.data_ptr(), keep_stride, out.data_ptr(), _bounds(),
            torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_attn_out_rows")
        self.row_calls += 1
        return out

    def post_attn_rows(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The layer after its attention for B rows: x [B, 1, hidden] (contiguous bf16), a
        [B, heads * d] the attention output before o_proj (bf16, contiguous) -> out [B, 1,
        hidden], as attn_out_rows computes it from its own attention (continuous batching
        attends each row over its request's keys itself: kernels.attention.attend_rows_native)."""
        b = x.shape[0]
        self._check_rows_x(x, "post_attn_rows")
        width = self.heads * self.head_dim
        if (a.shape != (b, width) or a.dtype != torch.bfloat16 or not a.is_contiguous()):
            raise ValueError(f"post_attn_rows: a must be contiguous bf16 [{b}, {width}], got "
                             f"{a.dtype} {tuple(a.shape)}")
        out = torch.empty_like(x)
        code = self.lib.hfd_decode_post_attn_rows(self._ref, b, x.data_ptr(), a.data_ptr(),
                                                  out.data_ptr(), _bounds(),
                                                  torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_post_attn_rows")
        self.row_calls += 1
        return out


# the weight kinds of the batched layer without AMX, by hfd_lin kind
_KIND_NAMES = {LIN_BF16: "bf16", LIN_INT8: "int8", LIN_INT8_TILED: "int8", LIN_INT4: "int4",
               LIN_INT4_TILED: "int4", LIN_INT4_A8: "W4A8", LIN_INT4_A8_TILED: "W4A8"}
# the native library use (_native.MIN_TIER) the torch path's linears of each kind take for a few
# rows (for more, the panel kernels: "panel", read by _kind_max_rows)
_KIND_USES = {"bf16": "bf16_gemv", "int8": "gemv", "int4": "int4", "W4A8": "a8"}


def _bounds():
    """{int8_gemv_max_rows, int4_native_max_rows} of the running tier, for the batched layer's
    choice between the quantized GEMVs and the panel kernels (csrc/cpu_decode.c: lin_batch)."""
    rows = crossovers.rows()
    return (ctypes.c_int64 * 2)(rows.int8_gemv_max_rows or 0, rows.int4_native_max_rows or 0)


def _kind_why(kind: str) -> str | None:
    """Why the torch path's linears of this weight kind do not run the batched layer's kernels
    at the running tier (None: they do, for the rows of _kind_max_rows)."""
    if _native.lib(_KIND_USES[kind]) is None:
        return (f"no AMX, and the native {kind} kernels do not run at the {_native.tier()} "
                "tier (the torch path's linears are not theirs)")
    return None


def _kind_max_rows(kind: str) -> int:
    """The most rows for which the torch path's linears of this kind run the kernels of the
    batched layer (csrc/cpu_decode.c: lin_batch) at the running tier."""
    rows = crossovers.rows()
    if kind == "W4A8":  # the same numbers at every row count (quant.linear_int4_a8_cpu)
        return AMX_MAX_ROWS
    if kind == "bf16":
        return max(rows.bf16_gemm_max_rows or 0, rows.bf16_gemv_max_rows or 0)
    few = rows.int8_gemv_max_rows if kind == "int8" else rows.int4_native_max_rows
    many = rows.int8_gemm_max_rows if kind == "int8" else rows.int4_gemm_max_rows
    if many is None or _native.lib("panel") is None:
        return few or 0
    return max(many, few or 0)


def _rows_why(lib: ctypes.CDLL, struct: _Layer, amx: bool) -> str | None:
    """Why the batched calls (csrc/cpu_decode.c: hfd_decode_attn_in_rows) cannot compute this
    layer on this CPU. With AMX they run every projection on its tiles, bf16 weights with
    hfd_linear_bf16, int8 row tiles with hfd_int8_amx and 4-bit codes with hfd_int4_linear /
    hfd_int4_amx (as the torch path's linear_int4_cpu at those rows); without, bf16 weights with the
    native bf16 dot products (lin_batch): the torch path's kernels for those rows, so the same
    bits. HF_DSINFER_NATIVE_AMX and the crossovers are read per call by DecodeLayer.rows_why."""
    if not amx:
        for lin in struct.lin:
            if lin.n == 0:  # OPT's absent up projection
                continue
            if lin.bias and lin.b_dt != _native.DTYPE_CODES[torch.bfloat16]:
                return "a projection bias that is not bf16"
            if (why := _panel_shape_why(lin)) is not None:
                return f"no AMX, and {why}"
        return None
    for lin in struct.lin:
        if lin.n == 0:  # OPT's absent up projection
            continue
        if lin.kind in (LIN_INT4_A8, LIN_INT4_A8_TILED):  # not AMX: hfd_int4_gemm_a8
            if (why := _panel_shape_why(lin)) is not None:
                return why
        elif lin.kind == LIN_INT8_TILED:
            if not lib.hfd_amx_int8_available():
                return "int8 projections and no AMX-INT8 on this CPU"
            if lin.n % 16:
                return f"an int8 {lin.n} x {lin.k} projection (AMX-INT8 takes 16-row blocks)"
        elif lin.kind in (LIN_INT4, LIN_INT4_TILED):
            g = lin.group
            if (lin.n % 32 or g <= 0 or g % 32 or lin.k % g
                    or (lin.kind == LIN_INT4_TILED and (lin.k // 2) % 64)):
                return (f"a 4-bit {lin.n} x {lin.k} projection in groups of {g} (the AMX int4 "
                        "kernel takes out features a multiple of 32, groups of 32, in features "
                        "of 128 tiled)")
        elif lin.kind != LIN_BF16:
            return ("row-major int8 projections (batched decode layers take bf16, int8 row "
                    "tiles and 4-bit codes)")
        elif lin.n % 32 or lin.k % 32:
            return f"a {lin.n} x {lin.k} projection (the AMX kernel takes multiples of 32)"
        if lin.bias and lin.b_dt != _native.DTYPE_CODES[torch.bfloat16]:
            return "a projection bias that is not bf16"
    return None


def _panel_shape_why(lin) -> str | None:
    """Why the panel kernel of this projection's kind (csrc/cpu_qgemm.c) does not take its
    shape, which the torch path's linear then gives to another kernel (None: it takes it)."""
    n, k = lin.n, lin.k
    if lin.kind == LIN_BF16:
        ok, need = k % 32 == 0 and n % 4 == 0, "in features a multiple of 32, out of 4"
    elif lin.kind in (LIN_INT8, LIN_INT8_TILED):
        ok = n % 16 == 0 and k % (64 if lin.kind == LIN_INT8_TILED else 32) == 0
        need = "out features a multiple of 16, in features of 32 (64 tiled)"
    else:
        g = lin.group
        ok = (n % 16 == 0 and g > 0 and g % 32 == 0 and k % g == 0
              and (lin.kind not in (LIN_INT4_TILED, LIN_INT4_A8_TILED) or (k // 2) % 64 == 0))
        need = "out features a multiple of 16, groups of 32, in features of 128 tiled"
    return None if ok else (f"a {n} x {k} projection the batched layer's kernel does not take "
                            f"({need})")


def keep_rows(mask: torch.Tensor | None, rows: int, sk: int) -> tuple[bool, torch.Tensor | None]:
    """(usable, keep) for the HF mask of `rows` single-query rows: keep [rows or 1, sk] uint8
    (1 = may attend), or None when every key of every row may be attended. Not usable for
    per-head masks, nor for float masks holding values other than 0 and "masked" (a bias the
    kernel does not add)."""
    if mask is None:
        return True, None
    if (mask.dim() != 4 or mask.shape[0] not in (1, rows) or mask.shape[1] != 1
            or mask.shape[2] != 1 or mask.shape[3] < sk):
        return False, None
    block = mask[:, 0, 0, :sk]
    if block.dtype == torch.bool:
        return True, block.contiguous().view(torch.uint8)
    keep = block > torch.finfo(block.dtype).min  # HF's additive masks: 0 or the dtype's min
    if bool((block[keep] != 0).any()):  # other values add to the scores: the torch path does it
        return False, None
    return True, keep.contiguous().view(torch.uint8)


def cache_kv_usable(k: Any, v: Any, d: int, rows: int = 1) -> bool:
    """The cache's keys / values are what the kernels read: bf16 CPU [rows, heads, Sk, d] with
    contiguous last dims (any other strides); for one row, also SlotRows over one index (keys
    in a paged cache: attn_out reads them through it)."""
    if isinstance(k, SlotRows):  # slots [S, heads, d] (the key and value views' S may differ)
        ks, vs = k.slots, getattr(v, "slots", None)
        return (rows == 1 and isinstance(v, SlotRows) and v.index is k.index
                and ks.dtype == vs.dtype == torch.bfloat16
                and ks.device.type == vs.device.type == "cpu"
                and ks.shape[1:] == vs.shape[1:] and ks.shape[2] == d
                and ks.stride(2) == 1 and vs.stride(2) == 1)
    return (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
            and k.device.type == "cpu" and v.device.type == "cpu"
            and k.dim() == 4 and k.shape[0] == rows and v.shape == k.shape and k.shape[3] == d
            and k.stride(3) == 1 and v.stride(3) == 1)


class LayerChain:
    """A model's batch-1 decode layers as one native call per step (csrc/cpu_decode.c:
    hfd_decode_layers): every layer's attn_in, the write of its key and value into its cache
    buffer, and its attn_out, with the same numerics as the per-layer calls. Build it again when
    any layer is rebuilt (`matches`)."""

    def __init__(self, layers: list[DecodeLayer]):
        if not layers:
            raise ValueError("LayerChain: no layers")
        self.layers = list(layers)
        self.lib = layers[0].lib
        self._structs = (ctypes.c_void_p * len(layers))(
            *(ctypes.addressof(layer.struct) for layer in layers))
        self.kv_heads, self.head_dim = layers[0].kv_heads, layers[0].head_dim
        # layers without RoPE (SmolLM3's NoPE layers) ignore the cos / sin the others share
        roped = [layer for layer in layers if layer.rope]
        self._roped = roped[0] if roped else None
        self.rope = self._roped is not None
        self.rotary_dim = self._roped.rotary_dim if roped else None
        if (any((layer.kv_heads, layer.head_dim) != (self.kv_heads, self.head_dim)
                for layer in layers)
                or any((layer.rope_dtype, layer.rotary_dim)
                       != (roped[0].rope_dtype, roped[0].rotary_dim) for layer in roped)):
            raise NativeUnsupported("layers of different KV shapes or RoPE")

    def matches(self, layers: list[DecodeLayer]) -> bool:
        return len(layers) == len(self.layers) and all(
            a is b for a, b in zip(layers, self.layers))

    def step(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
             rooms: list[tuple[torch.Tensor, torch.Tensor]], n: int,
             keep: torch.Tensor | None) -> torch.Tensor:
        """x [1, 1, hidden] bf16 -> the last layer's output. rooms: per layer the key / value
        buffers [1, kv_heads, >n, head_dim] (bf16, contiguous last dim) whose first n tokens are
        the cache; token n is written there. keep: [n + 1] uint8 or None (every key)."""
        count, d = len(self.layers), self.head_dim
        hidden = self.layers[0].hidden
        if (x.dtype != torch.bfloat16 or x.numel() != hidden or not x.is_contiguous()
                or x.device.type != "cpu"):
            raise ValueError(f"LayerChain.step: x must be {hidden} contiguous bf16 CPU values, "
                             f"got {x.dtype} {tuple(x.shape)}")
        if len(rooms) != count:
            raise ValueError(f"LayerChain.step: {len(rooms)} cache layers for {count} layers")
        strides, kp, vp = [], [], []
        for kb, vb in rooms:
            if not (kb.dtype == vb.dtype == torch.bfloat16 and kb.dim() == vb.dim() == 4
                    and kb.shape[0] == 1 and kb.shape[1] == self.kv_heads
                    and kb.shape[3] == d and vb.shape[:2] == kb.shape[:2]
                    and vb.shape[3] == d and min(kb.shape[2], vb.shape[2]) > n
                    and kb.stride(3) == 1 and vb.stride(3) == 1
                    and kb.device.type == vb.device.type == "cpu"):
                raise ValueError(
                    f"LayerChain.step: a cache buffer {tuple(kb.shape)} / {tuple(vb.shape)} "
                    f"{kb.dtype}; expected bf16 CPU [1, {self.kv_heads}, >{n}, {d}] with a "
                    "contiguous last dim")
            strides += [kb.stride(1), kb.stride(2), vb.stride(1), vb.stride(2)]
            kp.append(kb.data_ptr())
            vp.append(vb.data_ptr())
        if keep is not None and (keep.dtype != torch.uint8 or keep.numel() != n + 1
                                 or not keep.is_contiguous()):
            raise ValueError(f"LayerChain.step: keep must be {n + 1} contiguous uint8")
        if self.rope:
            cos_p, sin_p = self._roped._cos_sin(cos, sin, "LayerChain.step")
            if cos.numel() != self.rotary_dim or sin.numel() != self.rotary_dim:
                raise ValueError(f"LayerChain.step: cos / sin of {cos.numel()} values, not "
                                 f"{self.rotary_dim}")
        else:
            cos_p = sin_p = None
        out = torch.empty_like(x)
        code = self.lib.hfd_decode_layers(
            self._structs, count, x.data_ptr(), cos_p, sin_p, (ctypes.c_void_p * count)(*kp),
            (ctypes.c_void_p * count)(*vp), (ctypes.c_int64 * (4 * count))(*strides), n,
            None if keep is None else keep.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if code:
            _native.check(code, "hfd_decode_layers")
        for layer in self.layers:
            layer.calls += 1
        return out
