"""Mixture-of-experts: fused top-k gating, a dense token->expert table, grouped expert MLP.

DeepSpeed-MoE's inference recipe: route with one fused gating op, turn the routing into a dense
table (token rows sorted by expert plus per-expert offsets) instead of a one-hot [T, k, E]
mask and einsum, run each expert's MLP on its contiguous slice of rows (a grouped GEMM), and
combine the weighted rows back into token order.

topk_gating(router_logits [T, E], top_k) -> (weights [T, k] fp32, ids [T, k] int64)
    softmax_first=True   softmax in fp32 over all E, then top-k (Mixtral, Qwen2/3-MoE, OLMoE);
                         renormalize=True divides the k weights by their sum (Mixtral always,
                         Qwen2/3-MoE and OLMoE when config.norm_topk_prob).
    softmax_first=False  top-k over the logits, then softmax in fp32 over the k selected ones
                         (already normalized; `renormalize` changes nothing).
    Qwen2/3-MoE and OLMoE then cast the weights to the logits' dtype before the experts;
    Mixtral keeps them fp32. Callers reproduce that with `weights.to(dtype)`.
moe_align(ids [T, k], E) -> MoeAlignment(token_idx [T*k], flat_idx [T*k], expert_offsets [E+1])
    rows sorted by expert (stable, so tokens stay ascending inside an expert); row r is token
    token_idx[r], routing slot flat_idx[r] (= t * k + j), expert e owns rows
    expert_offsets[e]:expert_offsets[e+1]. Built with argsort / bincount / cumsum. An id >= E
    marks a dropped slot (capacity overflow, or an expert on another rank): such rows sort last,
    past expert_offsets[E], and no expert computes them.
grouped_expert_rows(x_sorted [R, H], gate_up_proj, down_proj, expert_offsets [E+1], act) -> [R, H]
    the unweighted expert outputs of expert-sorted rows (rows past offsets[E] come back as 0);
    the building block expert parallelism runs on the rows it receives.
combine_expert_rows(rows [T*k, H] (sorted), weights [T, k], align) -> [T, H]
    back to token order, times the routing weights, the k contributions summed.
grouped_expert_mlp(hidden [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], weights [T, k],
                   ids [T, k], act) -> [T, H]
    transformers 5's fused expert layout (MixtralExperts, Qwen2MoeExperts, OlmoeExperts):
    gate_up_proj[e] is an nn.Linear weight whose first I output rows are the gate, the next I
    the up projection; down_proj[e] maps I -> H. Numerics follow those modules: each GEMM
    rounds to hidden's dtype, act(gate) * up is rounded, the expert output times its routing
    weight is computed in the promoted dtype (fp32 for Mixtral's fp32 weights) and rounded to
    hidden's dtype, and contributions are summed into zeros by index_add_ in hidden's dtype in
    ascending expert order, as HF does (the CPU path sums each token's k contributions in one
    reduction instead: identical for k <= 2, one rounding fewer for k > 2).

CPU fast path: in bf16 with AMX, the native kernel of csrc/cpu_moe.c for any number of rows
(all experts in one call, the routing weights applied as it writes the rows); otherwise (fp32,
other activations, no AMX past ~1 row per expert) two grouped GEMMs with the expert weights as
the *left* operand,
F.grouped_mm(W [E, N, K], X^T [K, R], offs) -> [N, R], one call per projection and no Python
loop over experts: each expert's weight is read as stored (contiguous rows), empty experts cost
nothing, and small row counts avoid oneDNN's slow skinny x @ W^T shapes (measured:
docs/performance.md, "Behind the code").
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch, _native, crossovers, linear
from hf_dsinfer.kernels.activations import _ACT_CODE, gated_act_ref, resolve_activation
from hf_dsinfer.kernels.linear import dot_in_fp32
from hf_dsinfer.kernels.private_ops import verified


class MoeAlignment(NamedTuple):
    token_idx: torch.Tensor  # [T*k] int64, token of each expert-sorted row
    flat_idx: torch.Tensor  # [T*k] int64, position of the row in ids.reshape(-1)
    expert_offsets: torch.Tensor  # [E+1] int64, rows of expert e: offsets[e]:offsets[e+1]


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def topk_gating_ref(
    router_logits: torch.Tensor, top_k: int, softmax_first: bool = True, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF routers' numerics: softmax in fp32, torch.topk, optional renormalization."""
    if not softmax_first:
        top_logits, ids = torch.topk(router_logits, top_k, dim=-1)  # [T, k]
        return torch.softmax(top_logits.float(), dim=-1), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_align(ids: torch.Tensor, num_experts: int) -> MoeAlignment:
    """Dense token->expert table: rows sorted by expert, and per-expert row offsets."""
    flat = ids.reshape(-1)  # [T*k]
    flat_idx = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]  # [E], ids >= E dropped
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    return MoeAlignment(flat_idx // ids.shape[-1], flat_idx, offsets)


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str,
                out: torch.Tensor | None = None, kernels: bool = False):
    """One expert on its rows x [n, H]: act(gate) * up then down, HF's eager op sequence,
    written into `out` [n, H] (contiguous) when given. With `kernels` (the CPU fast paths; the
    references and the traced path keep HF's ops) the products run as the dense linears do
    (kernels/linear.py: linear_cpu): the tier's native bf16 GEMV and panel kernels for their
    rows, fp32 GEMMs for many bf16 rows on a CPU without bf16 dot products, F.linear else;
    each rounded once, as F.linear rounds. Past the native kernels' rows, bf16 on a oneDNN CPU
    at a tier with bf16 dot products fuses act and * up into the GEMMs' epilogues."""
    if not kernels:
        a = gated_act_ref(F.linear(x, gate_up), None, act)  # [n, I]
        return F.linear(a, down) if out is None else torch.matmul(a, down.t(), out=out)
    if (not linear.fp32_gemm_tier() and not linear.native_bf16_takes(x, gate_up)
            and _onednn_gated(x, gate_up, act)):
        a = _gated_onednn(x, gate_up)
    else:
        a = gated_act_ref(linear.linear_cpu(x, gate_up), None, act)  # [n, I]
    y = linear.linear_cpu(a, down)  # [n, H]
    return y if out is None else out.copy_(y)


def _gated_onednn(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T) [n, I] by torch's private oneDNN linear-pointwise ops."""
    inter = gate_up.shape[0] // 2
    gate = torch.ops.mkldnn._linear_pointwise(x, gate_up[:inter], None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, gate_up[inter:], None, "mul")


LINEAR_POINTWISE = "mkldnn._linear_pointwise"


def _probe_linear_pointwise(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """_gated_onednn against HF's op sequence on fixed operands (x [5, 64], gate_up [96, 64])."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    gate_up = (torch.randn(96, 64, generator=gen) / 8).to(dtype)
    return _gated_onednn(x, gate_up), gated_act_ref(F.linear(x, gate_up), None, "silu")


@functools.lru_cache(maxsize=1)
def _onednn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_gated(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> bool:
    """silu(x @ Wg^T) * (x @ Wu^T) as two oneDNN GEMMs with fused epilogues (torch's own CPU
    linear-pointwise ops, the ones inductor emits): in bf16 this skips a read-modify-write pass
    over the [n, 2I] intermediate (~30% of the gate-up time at 512 rows per expert). The
    activation is applied to the fp32 accumulator before rounding, one bf16 rounding fewer than
    HF's op sequence; fp32 keeps HF's exact ops. Private ops: used once a probe on this CPU
    agreed with HF's op sequence (private_ops.py)."""
    return (act == "silu" and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and gate_up.dtype == torch.bfloat16 and x.is_contiguous()
            and gate_up.is_contiguous() and not torch.compiler.is_compiling() and _onednn_bf16()
            and verified(LINEAR_POINTWISE, x.dtype, _probe_linear_pointwise))


def grouped_expert_mlp_ref(hidden, gate_up_proj, down_proj, weights, ids, act="silu"):
    """HF's experts loop (MixtralExperts.forward) without the one-hot mask."""
    act = resolve_activation(act)
    out = torch.zeros_like(hidden)  # [T, H]
    for e in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == e)
        y = _expert_mlp(hidden[token_idx], gate_up_proj[e], down_proj[e], act)
        y = y * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import Triton and define the kernels on first use (the module imports without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _topk_gating_kernel(
        logits_ptr, w_ptr, ids_ptr, E, stride_t,
        TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program per token: softmax and k rounds of argmax-and-mask over its E logits.
        t = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        z = tl.load(logits_ptr + t * stride_t + offs_e, mask=offs_e < E,
                    other=-float("inf")).to(tl.float32)
        if SOFTMAX_FIRST:
            p = tl.exp(z - tl.max(z, axis=0))
            z = p / tl.sum(p, axis=0)
        offs_k = tl.arange(0, BLOCK_K)  # BLOCK_K = next power of two >= TOP_K
        vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
        idx = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(z, axis=0)
            arg = tl.min(tl.where(z == best, offs_e, BLOCK_E), axis=0)  # first max, as topk
            vals = tl.where(offs_k == j, best, vals)
            idx = tl.where(offs_k == j, arg.to(tl.int64), idx)
            z = tl.where(offs_e == arg, -float("inf"), z)
        if SOFTMAX_FIRST:
            if RENORMALIZE:
                vals = vals / tl.sum(vals, axis=0)
        else:
            sel = tl.where(offs_k < TOP_K, vals, -float("inf"))
            p = tl.exp(sel - tl.max(sel, axis=0))
            vals = p / tl.sum(p, axis=0)
        tl.store(w_ptr + t * TOP_K + offs_k, vals, mask=offs_k < TOP_K)
        tl.store(ids_ptr + t * TOP_K + offs_k, idx, mask=offs_k < TOP_K)

    @triton.jit
    def _expert_gate_up_kernel(
        x_ptr, tok_ptr, w_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, H, I,
        stride_xt, stride_we, stride_wn, stride_om,
        ACT: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Tile = up to BLOCK_M sorted rows of one expert; gathers its tokens' hidden rows and
        # writes act(x @ gate.T) * (x @ up.T) for BLOCK_N intermediate columns.
        tile = tl.program_id(0)
        e = tl.load(tile_e_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        offs_r = tl.load(tile_r0_ptr + tile) + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_mask, n_mask = offs_r < r1, offs_n < I
        tok = tl.load(tok_ptr + offs_r, mask=r_mask, other=0)
        w_base = w_ptr + e * stride_we
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            wk_mask = k_mask[:, None] & n_mask[None, :]
            g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
            wg = tl.load(g_ptrs, mask=wk_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(g_ptrs + I * stride_wn, mask=wk_mask, other=0.0)
            if DOT_FP32:
                acc_g += tl.dot(xt.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                acc_u += tl.dot(xt.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            else:
                acc_g += tl.dot(xt, wg)
                acc_u += tl.dot(xt, wu)
        # Round where HF's eager chain rounds: each linear output, the activation, the product.
        dt = out_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        # ACT codes of activations._ACT_CODE, evaluated in fp32 (a nested @jit helper would
        # not resolve from this closure, so the five formulas are inlined).
        if ACT == 0:  # erf GELU
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        elif ACT == 1:  # tanh GELU = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))
            a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        elif ACT == 2:
            a = tl.maximum(g, 0.0)
        elif ACT == 4:  # squared ReLU
            a = tl.maximum(g, 0.0)
            a = a * a
        else:
            a = g * tl.sigmoid(g)
        a = a.to(dt).to(tl.float32)
        y = (a * acc_u.to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + offs_r[:, None] * stride_om + offs_n[None, :], y,
                 mask=r_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _expert_down_kernel(
        a_ptr, w_ptr, rw_ptr, flat_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, H, I,
        stride_am, stride_we, stride_wn, stride_om,
        DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Sorted rows [BLOCK_M, I] @ down[e].T -> [BLOCK_M, BLOCK_N] of H, times routing weight.
        tile = tl.program_id(0)
        e = tl.load(tile_e_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        offs_r = tl.load(tile_r0_ptr + tile) + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_mask, n_mask = offs_r < r1, offs_n < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            at = tl.load(a_ptr + offs_r[:, None] * stride_am + offs_k[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(at.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(at, wt)
        dt = out_ptr.dtype.element_ty
        flat = tl.load(flat_ptr + offs_r, mask=r_mask, other=0)
        rw = tl.load(rw_ptr + flat, mask=r_mask, other=0.0).to(tl.float32)
        y = (acc.to(dt).to(tl.float32) * rw[:, None]).to(dt)
        tl.store(out_ptr + offs_r[:, None] * stride_om + offs_n[None, :], y,
                 mask=r_mask[:, None] & n_mask[None, :])

    return triton, _topk_gating_kernel, _expert_gate_up_kernel, _expert_down_kernel


def topk_gating_triton(
    router_logits: torch.Tensor, top_k: int, softmax_first: bool = True, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token: fp32 softmax and top-k in registers, no [T, E] probs in memory."""
    triton, kernel, _, _ = _kernels()
    logits = router_logits.reshape(-1, router_logits.shape[-1]).contiguous()  # [T, E]
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                 SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize,
                 BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids


def _tile_table(offsets: torch.Tensor, block_m: int):
    """Per-tile (expert, first row, end row) so each tile of <= block_m rows has one expert."""
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_e = torch.repeat_interleave(torch.arange(len(counts), device=offsets.device), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles  # [E]
    within = torch.arange(len(tile_e), device=offsets.device) - first_tile[tile_e]
    r0 = offsets[tile_e] + within * block_m
    return tile_e, r0, offsets[tile_e + 1]


def _launch_expert_kernels(x, tok, gate_up_proj, down_proj, rw, flat, offsets, act: str):
    """Gate-up and down grouped-GEMM launches over expert-sorted rows -> y [R, H] (rows past
    offsets[E] stay 0); row r reads hidden row tok[r] and routing weight rw[flat[r]]."""
    triton, _, gate_up_kernel, down_kernel = _kernels()
    h, inter = x.shape[1], gate_up_proj.shape[1] // 2
    gu, dn = gate_up_proj.contiguous(), down_proj.contiguous()
    tile_e, r0, r1 = _tile_table(offsets, 16)
    rows = tok.numel()
    a = torch.empty(rows, inter, dtype=x.dtype, device=x.device)  # [R, I]
    y = torch.zeros(rows, h, dtype=x.dtype, device=x.device)  # [R, H]
    fp32 = dot_in_fp32(x.dtype)
    gate_up_kernel[(len(tile_e), triton.cdiv(inter, 32))](
        x, tok, gu, a, tile_e, r0, r1, h, inter, x.stride(0), gu.stride(0),
        gu.stride(1), a.stride(0), ACT=_ACT_CODE[resolve_activation(act)], DOT_FP32=fp32,
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    down_kernel[(len(tile_e), triton.cdiv(h, 32))](
        a, dn, rw, flat, y, tile_e, r0, r1, h, inter, a.stride(0),
        dn.stride(0), dn.stride(1), y.stride(0), DOT_FP32=fp32,
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    return y


def grouped_expert_mlp_triton(hidden, gate_up_proj, down_proj, weights, ids, act="silu"):
    """Two grouped-GEMM launches over expert-sorted rows, then index_add_ into token order."""
    x = hidden.contiguous()
    align = moe_align(ids, gate_up_proj.shape[0])
    y = _launch_expert_kernels(x, align.token_idx, gate_up_proj, down_proj,
                               weights.contiguous(), align.flat_idx, align.expert_offsets, act)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, align.token_idx, y)  # y already weighted and rounded


def grouped_expert_rows_triton(x_sorted, gate_up_proj, down_proj, offsets, act="silu"):
    """The same launches on rows already sorted by expert, with unit routing weights."""
    x = x_sorted.contiguous()
    rows = torch.arange(x.shape[0], device=x.device)
    ones = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    return _launch_expert_kernels(x, rows, gate_up_proj, down_proj, ones, rows, offsets, act)


# ----------------------------------------------------------------------------------------------
# CPU fast path
# ----------------------------------------------------------------------------------------------


# torch's grouped GEMM wants the ragged operand's row stride 16-byte aligned: pad rows to 8.
_GROUPED_MM_ALIGN = 8


def _grouped_mm_fits(*weights: torch.Tensor) -> bool:
    """F.grouped_mm exists and every weight's strides are 16-byte multiples (it refuses
    others, e.g. an intermediate size of 14 fp32 columns after expert slicing)."""
    return hasattr(F, "grouped_mm") and all(
        s * w.element_size() % 16 == 0 for w in weights for s in w.stride()[:-1])


def _grouped_rows_loop(x_sorted, gate_up_proj, down_proj, bounds: list[int], act: str,
                       kernels: bool = False):
    """One GEMM pair per expert that has rows (idle experts cost nothing): the fallback without
    F.grouped_mm, and the faster path once experts get many rows each (oneDNN's GEMMs beat
    torch's CPU grouped GEMM from ~32 rows per expert: docs/performance.md, "Behind the code")."""
    y = torch.empty_like(x_sorted)  # [R, H]
    y[bounds[-1]:] = 0  # dropped rows (capacity factor) are never computed
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            _expert_mlp(x_sorted[lo:hi], gate_up_proj[e], down_proj[e], act, out=y[lo:hi],
                        kernels=kernels)
    return y


# Rows per active expert from which one oneDNN GEMM pair per expert beats F.grouped_mm on CPU
# (measured with benchmarks/moe.py's shapes: grouped_mm wins at <=16, the loop from 64 up).
_LOOP_MIN_ROWS_PER_EXPERT = 32


def _grouped_rows_gmm(x_sorted, gate_up_proj, down_proj, offsets, act: str):
    """Two grouped GEMMs, weights on the left: h^T = W_gu[e] @ X_e^T, y^T = W_d[e] @ a_e^T."""
    rows, hidden = x_sorted.shape
    inter = gate_up_proj.shape[1] // 2
    padded = -(-rows // _GROUPED_MM_ALIGN) * _GROUPED_MM_ALIGN
    xt = x_sorted.new_empty(hidden, padded)  # [H, R'], columns past offsets[E] are ignored
    xt[:, :rows] = x_sorted.t()
    offs = offsets[1:].to(torch.int32)  # [E] cumulative row counts
    ht = F.grouped_mm(gate_up_proj, xt, offs=offs)  # [2I, R']
    a = gated_act_ref(ht[:inter], ht[inter:], act)  # [I, R'], HF's rounding per op
    yt = F.grouped_mm(down_proj, a, offs=offs)  # [H, R']
    return yt[:, :rows].t()  # [R, H] view


def _active_experts(bounds: list[int]) -> int:
    return sum(hi > lo for lo, hi in itertools.pairwise(bounds))


def _many_rows(bounds: list[int]) -> bool:
    """No routed rows, or many rows per active expert (GEMM-bound, not weight-read-bound)."""
    return bounds[-1] == 0 or bounds[-1] >= _LOOP_MIN_ROWS_PER_EXPERT * _active_experts(bounds)


def _native_bf16_linears(x_sorted: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """bf16 experts at a tier whose native bf16 GEMV and panel kernels run (linear_cpu; every
    tier but amx has a panel bound in kernels/crossovers.py). There one call pair per expert
    reads each weight once at few rows, where F.grouped_mm (weights on the left) was several
    times slower. 8 experts, hidden 1024, intermediate 3584 (benchmarks/moe.py's), the same rows
    for each expert, on a 2-core Zen 4, 2026-11-28, ms at 1 / 4 / 16 / 64 rows per expert:
    as an AVX2 CPU (torch and oneDNN capped too), one linear_cpu pair per expert 6.3 / 11.7 /
    44.6 / 94.2, F.linear pairs 5.8 / 18.0 / 102.7 / 266.2, the grouped GEMMs 50.8 / 267.9 /
    1128 / 6981; at its avx512_bf16 tier 6.8 / 10.7 / 16.1 / 43.1, 14.4 / 13.6 / 18.5 / 40.3 and
    17.5 / 17.8 / 19.4 / 38.6."""
    return (x_sorted.dtype == gate_up_proj.dtype == torch.bfloat16
            and x_sorted.device.type == "cpu"
            and crossovers.rows().bf16_gemm_max_rows is not None
            and _native.lib("bf16_gemv") is not None)


def _per_expert_gemms(bounds: list[int], gate_up_proj, down_proj, x_sorted) -> bool:
    """One GEMM pair per active expert (else two grouped GEMMs): without F.grouped_mm, with no
    routed rows, with many rows per active expert, or where the tier's native bf16 linears run
    (_native_bf16_linears)."""
    return (not _grouped_mm_fits(gate_up_proj, down_proj) or _many_rows(bounds)
            or _native_bf16_linears(x_sorted, gate_up_proj))


# Rows per active expert up to which the native bf16 kernel (csrc/cpu_moe.c) is the fastest CPU
# path; with AMX, any. Measured by `benchmarks/moe_experts.py --rows 1 4 16 64 128 256 512`
# (hidden 1024, intermediate 3584, 8 experts, weights cycled through 705 MB, past this VM's L3),
# ms native AMX / native AVX-512 / F.grouped_mm / one oneDNN GEMM pair per expert:
#   1: 7.74 / 7.76 / 9.00 / 13.39      4: 7.80 / 11.25 / 9.40 / 14.53
#  16: 7.74 / 21.35 / 11.69 / 15.04   64: 9.26 / 66.50 / 21.90 / 23.94
# 128: 14.66 / 125.45 / 36.36 / 30.40  256: 24.93 / 246.15 / 58.67 / 39.40
# 512: 46.11 / 499.99 / 114.10 / 67.67
# Without AMX the dot products, not the weight reads, bound the AVX-512 path from 2 rows on.
_NATIVE_MAX_ROWS_PER_EXPERT = {"amx": float("inf"), "avx512": 1.5}


def _amx_tiles(hidden: int, inter: int) -> bool:
    """The native kernel runs on AMX tiles for these sizes (else its AVX-512 path)."""
    return hidden % 32 == 0 and inter % 32 == 0 and _native.amx_available()


def _native_moe_lib(x_sorted, gate_up_proj, down_proj, act: str, bounds: list[int]):
    """The native library when its bf16 expert kernel (csrc/cpu_moe.c) takes these rows, else
    None: any number of rows per active expert on AMX, about one without (see above); silu, bf16
    rows and weights, contiguous, on CPU, outside torch.compile."""
    fits = (0 < bounds[-1] and act == "silu" and x_sorted.device.type == "cpu"
            and x_sorted.dtype == gate_up_proj.dtype == down_proj.dtype == torch.bfloat16
            and x_sorted.is_contiguous() and gate_up_proj.is_contiguous()
            and down_proj.is_contiguous() and not torch.compiler.is_compiling())
    lib = _native.lib() if fits else None
    if lib is None:
        return None
    most = _NATIVE_MAX_ROWS_PER_EXPERT[
        "amx" if _amx_tiles(x_sorted.shape[1], down_proj.shape[2]) else "avx512"]
    return lib if bounds[-1] <= most * _active_experts(bounds) else None


def _native_moe_rows(lib, x_sorted, gate_up_proj, down_proj, offsets, kept: int,
                     row_weights: torch.Tensor | None = None):
    """Expert outputs [R, H] of expert-sorted bf16 rows from the native kernel; rows past
    offsets[E] (dropped) are 0. Reads each expert weight row once (see csrc/cpu_moe.c). With
    row_weights ([>= kept], sorted like the rows) each output row is bf16(bf16(y) * w), HF's
    weighting of an expert's output by its routing weight (an fp32 weight promotes, a bf16 one
    is exact in fp32), computed as the rows are written."""
    num_experts, two_inter, hidden = gate_up_proj.shape
    offs = offsets.contiguous()  # int64, from moe_align / the expert-parallel receive path
    amx = _amx_tiles(hidden, two_inter // 2)
    # act(gate) * up: the AVX-512 path's scratch (the AMX path keeps its own, packed)
    a = None if amx else x_sorted.new_empty(kept, two_inter // 2)
    rw = None if row_weights is None else row_weights[:kept].float().contiguous()
    y = torch.empty_like(x_sorted)
    y[kept:] = 0
    code = lib.hfd_moe_bf16(x_sorted.data_ptr(), gate_up_proj.data_ptr(), down_proj.data_ptr(),
                            offs.data_ptr(), num_experts, hidden, two_inter // 2,
                            None if a is None else a.data_ptr(), y.data_ptr(),
                            None if rw is None else rw.data_ptr(), 0, int(amx),
                            torch.get_num_threads())
    if code:
        _native.check(code, "hfd_moe_bf16")
    return y


def grouped_expert_rows_cpu(x_sorted, gate_up_proj, down_proj, offsets, act="silu"):
    if torch.compiler.is_compiling():
        act = resolve_activation(act)
        return traced_expert_rows(x_sorted, offsets, lambda e, x: _expert_mlp(
            x, gate_up_proj[e], down_proj[e], act))
    act = resolve_activation(act)
    bounds = offsets.tolist()  # one host sync
    lib = _native_moe_lib(x_sorted, gate_up_proj, down_proj, act, bounds)
    if lib is not None:
        return _native_moe_rows(lib, x_sorted, gate_up_proj, down_proj, offsets, bounds[-1])
    if _per_expert_gemms(bounds, gate_up_proj, down_proj, x_sorted):
        return _grouped_rows_loop(x_sorted, gate_up_proj, down_proj, bounds, act, kernels=True)
    y = _grouped_rows_gmm(x_sorted, gate_up_proj, down_proj, offsets, act)
    if bounds[-1] < x_sorted.shape[0]:  # dropped rows: never computed, uninitialized
        y[bounds[-1]:] = 0
    return y


# Under torch.compile the two CPU entry points read no offsets on the host (a data-dependent
# branch, which fullgraph=True refuses): every expert runs over every row and keeps its own, E / k
# times the expert work, in one graph. (Custom ops around the eager code aborted the process
# when inductor's cached graph called them in a later process: torch 2.13.)
def _traced_mlp(hidden, gate_up_proj, down_proj, weights, ids, act):
    """grouped_expert_mlp_cpu's result, summed in expert order as HF's eager loop does."""
    act = resolve_activation(act)
    out = torch.zeros_like(hidden)
    for e in range(gate_up_proj.shape[0]):
        w = (weights * (ids == e)).sum(dim=-1)  # [T]: e's routing weight, 0 where not routed
        y = _expert_mlp(hidden, gate_up_proj[e], down_proj[e], act)
        out = out + (y * w[:, None]).to(hidden.dtype)
    return out


def traced_expert_rows(x_sorted: torch.Tensor, offsets: torch.Tensor, expert) -> torch.Tensor:
    """Expert-sorted rows through `expert(e, rows)` without reading offsets on the host: every
    expert runs over every row and keeps its own ([offsets[e], offsets[e+1])); rows past
    offsets[E] are 0. Also the quantized experts' traced path (injection.moe)."""
    row = torch.arange(x_sorted.shape[0], device=x_sorted.device)[:, None]
    y = torch.zeros_like(x_sorted)
    for e in range(offsets.shape[0] - 1):
        y = torch.where((row >= offsets[e]) & (row < offsets[e + 1]), expert(e, x_sorted), y)
    return y


def grouped_expert_rows_ref(x_sorted, gate_up_proj, down_proj, offsets, act="silu"):
    return _grouped_rows_loop(x_sorted, gate_up_proj, down_proj, offsets.tolist(),
                              resolve_activation(act))


def combine_expert_rows(rows: torch.Tensor, weights: torch.Tensor, align: MoeAlignment):
    """Expert-sorted rows [T*k, H] -> [T, H]: back to slot order by one gather, times the routing
    weight in the promoted dtype (fp32 for Mixtral's fp32 weights), rounded to the rows' dtype as
    HF rounds each contribution, then each token's k contributions summed."""
    t, k = weights.shape
    inverse = torch.empty_like(align.flat_idx)
    inverse[align.flat_idx] = torch.arange(len(inverse), device=inverse.device)
    per_slot = rows.index_select(0, inverse).view(t, k, -1)  # [T, k, H]
    return (per_slot * weights[..., None]).to(rows.dtype).sum(dim=1)  # [T, H]


def grouped_expert_mlp_cpu(hidden, gate_up_proj, down_proj, weights, ids, act="silu"):
    """Align, one gather into expert-sorted rows, then the native kernel (bf16 on AMX: every
    expert in one call, rows weighted as written) or two grouped GEMMs, and combine; or, with
    many rows per expert off the native path, one GEMM pair per active expert, each combined
    while its rows are hot."""
    if torch.compiler.is_compiling():
        return _traced_mlp(hidden, gate_up_proj, down_proj, weights, ids, act)
    align = moe_align(ids, gate_up_proj.shape[0])
    x = hidden.index_select(0, align.token_idx)  # [T*k, H], contiguous per expert
    bounds = align.expert_offsets.tolist()  # one host sync
    act = resolve_activation(act)
    lib = _native_moe_lib(x, gate_up_proj, down_proj, act, bounds)
    w_sorted = weights.reshape(-1).index_select(0, align.flat_idx)  # [T*k], sorted by expert
    kept = bounds[-1]  # dropped slots (capacity factor) sort last and are never computed
    if lib is not None:  # [T*k, H], already weighted
        y = _native_moe_rows(lib, x, gate_up_proj, down_proj, align.expert_offsets, kept,
                             row_weights=w_sorted)
    elif _per_expert_gemms(bounds, gate_up_proj, down_proj, x):
        return _loop_and_combine(hidden, x, gate_up_proj, down_proj, w_sorted, align, bounds,
                                 act)
    else:  # [T*k, H]; rows past bounds[-1] unset
        y = _grouped_rows_gmm(x, gate_up_proj, down_proj, align.expert_offsets, act)
        y[:kept].mul_(w_sorted[:kept, None])
    out = torch.zeros_like(hidden)  # [T, H], summed in expert order as HF's eager loop does
    return out.index_add_(0, align.token_idx[:kept], y[:kept])


def _loop_and_combine(hidden, x_sorted, gate_up_proj, down_proj, w_sorted, align, bounds, act):
    """Per active expert: its rows' MLP, times their routing weights (w_sorted [T*k], sorted by
    expert; in the promoted dtype, rounded to the rows' dtype), index-added into the output.
    Expert by expert, in expert order: the accumulation order of HF's eager experts loop, with
    no [T*k, H] intermediate."""
    out = torch.zeros_like(hidden)  # [T, H]
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y = _expert_mlp(x_sorted[lo:hi], gate_up_proj[e], down_proj[e], act, kernels=True)
            out.index_add_(0, align.token_idx[lo:hi], y.mul_(w_sorted[lo:hi, None]))
    return out


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def topk_gating(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    softmax_first: bool = True,
    renormalize: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) for router logits [T, E]."""
    fn = _dispatch.pick(backend, router_logits.device, ref=topk_gating_ref,
                        triton_fn=topk_gating_triton)
    return fn(router_logits, top_k, softmax_first, renormalize)


def grouped_expert_mlp(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str = "silu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]) for hidden [T, H] -> [T, H]."""
    fn = _dispatch.pick(backend, hidden.device, ref=grouped_expert_mlp_ref,
                        triton_fn=grouped_expert_mlp_triton, cpu_fn=grouped_expert_mlp_cpu)
    return fn(hidden, gate_up_proj, down_proj, weights, ids, act)


def grouped_expert_rows(
    x_sorted: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    expert_offsets: torch.Tensor,
    act: str = "silu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Unweighted expert outputs [R, H] of expert-sorted rows x_sorted [R, H]; rows past
    expert_offsets[E] (dropped) come back as zeros."""
    fn = _dispatch.pick(backend, x_sorted.device, ref=grouped_expert_rows_ref,
                        triton_fn=grouped_expert_rows_triton, cpu_fn=grouped_expert_rows_cpu)
    return fn(x_sorted, gate_up_proj, down_proj, expert_offsets, act)
