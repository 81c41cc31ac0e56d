"""Scaled dot-product attention with GQA, masks, ALiBi bias and sliding windows.

    out = softmax(q @ k^T * scale + bias, masked) @ v

Shapes: q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq % Hkv == 0 (grouped-query attention:
query head h reads kv head h // (Hq // Hkv), as HF's repeat_kv); out [B, Hq, Sq, D] in q's dtype.

Which keys a query may attend (all conditions together):
    mask    bool (True = may attend) or additive float (0 / large negative), broadcastable to
            [B, Hq, Sq, Sk]: the 4-D masks HF's mask builders produce for sdpa (bool) and eager
            (float). A float entry <= finfo(dtype).min (HF's "masked" value) or -inf counts as
            masked; any other float value is added to the score.
    causal  query i (of Sq) sees key j iff j <= i + (Sk - Sq): bottom-right aligned, so with a
            KV cache of Sk - Sq past tokens the new queries sit at the end.
    window  additionally key j is masked when (i + Sk - Sq) - j >= window (HF's
            sliding_window_overlay: keep kv_idx > q_idx - window).
    bias    additive float [B, Hq, 1 or Sq, Sk] (ALiBi), added to the scaled scores.

softcap (Gemma 2): the scaled scores become `tanh(scores / softcap) * softcap` before the bias
and the mask, as HF's eager_attention_forward does. Neither torch's fused CPU kernel nor the
Triton kernel computes it, so soft-capped attention runs the reference on every backend.

Numerics (HF eager_attention_forward): scores are computed in q's dtype, softmax in fp32, the
probabilities cast back to q's dtype before the matmul with v. A query row with no attendable
key (e.g. a left-padding position) returns zeros, never NaN: a NaN there would reach later
tokens through 0 * NaN in the next layers. (HF eager gives such rows a uniform average of v;
they are padding and never read, but must stay finite.)

Backends: `attention_ref` (the eager math), `attention_cpu` (torch's fused
F.scaled_dot_product_attention CPU kernel), `attention_triton` (a flash-attention kernel with an
online softmax; one program handles a block of queries for all query heads of one kv head, so
each K/V tile is loaded once per GQA group; decode, Sq == 1, launches it with one program per
(batch, kv head) walking the whole cache).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _dispatch, _native


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> int:
    """Return the GQA group size Hq // Hkv."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(
            f"attention: query heads must be a multiple of kv heads, got Hq={hq}, Hkv={hkv}. "
            "Fix: pass q as [B, Hq, Sq, D] and k, v as [B, Hkv, Sk, D]."
        )
    return hq // hkv


def _keep_mask(mask: torch.Tensor | None, causal: bool, window: int | None, sq: int, sk: int,
               device: torch.device) -> torch.Tensor | None:
    """bool, broadcastable to [B, Hq, Sq, Sk], True = may attend; None when nothing is masked."""
    keep = None
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    if causal or window is not None:
        q_pos = torch.arange(sq, device=device)[:, None] + (sk - sq)  # [Sq, 1]
        k_pos = torch.arange(sk, device=device)[None, :]  # [1, Sk]
        pos_keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if causal:
            pos_keep &= k_pos <= q_pos
        if window is not None:
            pos_keep &= (q_pos - k_pos) < window
        keep = pos_keep if keep is None else keep & pos_keep
    return keep


def attention_ref(q, k, v, *, scale, mask=None, causal=False, bias=None, window=None,
                  softcap=None, sinks=None):
    """Reference: HF's eager_attention_forward, plus causal/window masks and zeroed empty rows.
    sinks [Hq]: a learned logit per head that joins each row's softmax and is then dropped
    (gpt-oss), so a row's weights over its keys sum to less than one."""
    rep = _check_heads(q, k)
    k = k.repeat_interleave(rep, dim=1)  # [B, Hq, Sk, D], HF's repeat_kv
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, Hq, Sq, Sk] in q's dtype
    if softcap is not None:  # HF's three eager ops, in q's dtype
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    keep = _keep_mask(mask, causal, window, q.shape[2], k.shape[2], q.device)
    if keep is not None:
        # HF's finfo.min rather than -inf: a row with every key masked stays finite (then
        # zeroed below); inductor's AVX2 code let the NaN of an all -inf row through.
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # [B, Hq, Sq, Sk + 1]: the sink column is the last, dropped after the softmax
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1,
                              dtype=torch.float32)[..., :-1]
    if keep is not None:  # a row of only -inf is NaN after softmax: make it attend nothing
        probs = probs.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    return torch.matmul(probs.to(q.dtype), v)


# ----------------------------------------------------------------------------- Triton kernel
# Program (pid_q, b * Hkv + hk) owns a tile of BLOCK_M = BLOCK_G * BLOCK_Q rows: BLOCK_G query
# heads of kv head hk (h = hk * rep + g) times BLOCK_Q query positions. It streams K/V in
# BLOCK_N-key tiles, each loaded once for the whole group, keeping fp32 running max m, sum l
# and output acc (online softmax). Scores are rounded to q's dtype after the matmul and after
# the scale, like the eager matmul and multiply; keys outside causal/window bounds are skipped.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and define its kernels (once per process)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _attention_kernel(Q, K, V, O, MASK, BIAS,
                          sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                          smb, smh, smq, smk, sbb, sbh, sbq, sbk,
                          hkv, rep, sq, sk, dim, dim_v, scale, mask_min, window,
                          MASK_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                          HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          DOT_FP32: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        pid_q, pid_bh, pid_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, hk = (pid_bh // hkv).to(tl.int64), pid_bh % hkv
        r = tl.arange(0, BLOCK_G * BLOCK_Q)
        g = pid_g * BLOCK_G + r // BLOCK_Q  # query head within the group, over grid axis 2
        i = pid_q * BLOCK_Q + r % BLOCK_Q  # query index among Sq
        h = (hk * rep + g).to(tl.int64)  # query head
        row_ok = (g < rep) & (i < sq)
        q_pos = i + (sk - sq)  # absolute position of the query in the key sequence
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        dv = tl.arange(0, BLOCK_DV)  # value dims: MLA's absorbed decode has dim_v != dim
        dv_ok = dv < dim_v
        dt = O.dtype.element_ty

        q_ptrs = Q + b * sqb + h[:, None] * sqh + i[:, None] * sqs + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full((BLOCK_G * BLOCK_Q,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G * BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_G * BLOCK_Q, BLOCK_DV), tl.float32)

        lo = 0
        hi = sk
        if CAUSAL:  # the last query of this tile sees keys up to its own position
            hi = tl.minimum(sk, (pid_q + 1) * BLOCK_Q + sk - sq)
        if HAS_WINDOW:  # the first query of this tile sees keys after its position - window
            lo = tl.maximum(0, pid_q * BLOCK_Q + sk - sq - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < sk
            kt = tl.load(K + b * skb + hk * skh + n[None, :] * sks + d[:, None],
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # [D, N]
            if DOT_FP32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [M, N], fp32 accumulate
            s = (s.to(dt).to(tl.float32) * scale).to(dt).to(tl.float32)
            keep = row_ok[:, None] & n_ok[None, :]
            if HAS_BIAS:
                bv = tl.load(BIAS + b * sbb + h[:, None] * sbh + i[:, None] * sbq + n[None, :] * sbk,
                             mask=keep, other=0.0)
                s = (s + bv.to(tl.float32)).to(dt).to(tl.float32)
            if MASK_KIND == 1:  # bool: True = may attend
                mv = tl.load(MASK + b * smb + h[:, None] * smh + i[:, None] * smq
                             + n[None, :] * smk, mask=keep, other=0)
                keep = keep & (mv != 0)
            if MASK_KIND == 2:  # additive float; HF's finfo.min (or -inf) means masked
                mv = tl.load(MASK + b * smb + h[:, None] * smh + i[:, None] * smq
                             + n[None, :] * smk, mask=keep, other=0.0).to(tl.float32)
                keep = keep & (mv > mask_min)
                s = s + mv
            if CAUSAL:
                keep = keep & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                keep = keep & ((q_pos[:, None] - n[None, :]) < window)
            s = tl.where(keep, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with nothing kept yet has m_new = -inf; shift by 0 so exp gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(V + b * svb + hk * svh + n[:, None] * svs + dv[None, :],
                         mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [N, DV]
            # Probabilities are rounded to v's dtype before the matmul, as eager's .to(q.dtype).
            pv = p.to(dt)
            if DOT_FP32:
                vt, pv = vt.to(tl.float32), pv.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=DOT_PRECISION)
            m_i = m_new

        out = tl.where(l_i[:, None] > 0.0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        o_ptrs = O + b * sob + h[:, None] * soh + i[:, None] * sos + dv[None, :]
        tl.store(o_ptrs, out.to(dt), mask=row_ok[:, None] & dv_ok[None, :])

    return types.SimpleNamespace(
        cdiv=triton.cdiv, next_power_of_2=triton.next_power_of_2,
        attention=_attention_kernel,
    )


def _strides4(t: torch.Tensor | None, shape: tuple[int, int, int, int]) -> tuple[int, ...]:
    """Strides of t broadcast to `shape` (0 on broadcast dims); zeros when t is None."""
    if t is None:
        return (0, 0, 0, 0)
    return t.expand(shape).stride()


def _launch(q, k, v, scale, mask, causal, bias, window, block_q, block_n):
    """Run _attention_kernel with query tiles of block_q positions (per GQA group)."""
    kern = _kernels()
    bsz, hq, sq, dim = q.shape
    hkv, sk, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    rep = hq // hkv
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((bsz, hq, sq, dim_v), dtype=q.dtype, device=q.device)
    full = (bsz, hq, sq, sk)
    kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    mask_min = torch.finfo(mask.dtype).min if kind == 2 else 0.0
    if kind == 1:
        mask = mask.view(torch.uint8)  # same bytes; Triton loads uint8 more portably than i1
    block_d = max(16, kern.next_power_of_2(dim))
    wide = block_d > 256  # MLA's absorbed keys (latent + rope, 576 in DeepSeek-V2/V3)
    if wide:  # a [D, N] key tile and a [N, DV] value tile must fit in shared memory
        block_n = 16
    # tl.dot needs at least 16 rows: pad the head group when there are few query positions.
    # At most 64 rows per program (16 for wide heads); more heads per kv head (MLA's absorbed
    # decode: every query head shares one latent) are split over the grid's third axis.
    rows = 16 if wide else 64
    block_g = max(min(kern.next_power_of_2(rep), max(1, rows // block_q)), 16 // block_q)
    grid = (kern.cdiv(sq, block_q), bsz * hkv, kern.cdiv(rep, block_g))
    kern.attention[grid](
        q, k, v, out, mask if mask is not None else q, bias if bias is not None else q,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *_strides4(mask, full), *_strides4(bias, full),
        hkv, rep, sq, sk, dim, dim_v, scale, mask_min, window or 0,
        MASK_KIND=kind, HAS_BIAS=bias is not None, CAUSAL=causal, HAS_WINDOW=window is not None,
        # fp32 inputs: exact fp32 products ("ieee"), not TF32, to stay close to eager; other
        # dtypes use the default (tensor cores with fp32 accumulation).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        # Triton's CPU interpreter has no bf16 matmul (numpy); bf16 products are exact in fp32,
        # so upcasting there computes the same dot product.
        DOT_FP32=q.dtype == torch.bfloat16 and _dispatch.triton_interpreting(),
        BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=max(16, kern.next_power_of_2(dim_v)),
        # wide fp32 tiles take twice the bytes: unpipelined, they fit A100's and H100's
        # shared memory (tests/kernels/test_triton_aot.py checks every launch's)
        **({"num_stages": 1} if wide and q.dtype == torch.float32 else {}),
    )
    return out


def _attention_prefill_triton(q, k, v, scale, mask, causal, bias, window):
    rep = q.shape[1] // k.shape[1]
    block_q = max(1, 64 // _kernels().next_power_of_2(rep))  # ~64 rows per program
    return _launch(q, k, v, scale, mask, causal, bias, window, block_q=block_q, block_n=32)


def _attention_decode_triton(q, k, v, scale, mask, causal, bias, window):
    # Sq == 1: one program per (batch, kv head) holds all query heads of the group as its rows
    # and walks the whole KV cache once, in wider key tiles.
    return _launch(q, k, v, scale, mask, causal, bias, window, block_q=1, block_n=64)


def attention_triton(q, k, v, *, scale, mask=None, causal=False, bias=None, window=None):
    _check_heads(q, k)
    launch = _attention_decode_triton if q.shape[2] == 1 else _attention_prefill_triton
    return launch(q, k, v, scale, mask, causal, bias, window)


def _sdpa_mask(q, k, mask, causal, bias, window):
    """(attn_mask, is_causal, keep) for F.scaled_dot_product_attention; keep as _keep_mask."""
    sq, sk = q.shape[2], k.shape[2]
    if mask is None and bias is None and window is None:
        if not causal or sq == 1:  # decode: the one query sees the whole cache
            return None, False, None
        if sq == sk:  # sdpa's is_causal is top-left aligned, equal to ours only when Sq == Sk
            return None, True, None
    keep = _keep_mask(mask, causal, window, sq, sk, q.device)
    if bias is None and (mask is None or mask.dtype == torch.bool):
        return keep, False, keep
    additive = torch.zeros((), dtype=q.dtype, device=q.device)
    if bias is not None:
        additive = additive + bias
    if mask is not None and mask.dtype != torch.bool:
        additive = additive + mask
    if keep is not None:
        additive = additive.masked_fill(~keep, float("-inf"))
    return additive.to(q.dtype), False, keep


def attention_cpu(q, k, v, *, scale, mask=None, causal=False, bias=None, window=None):
    """torch's fused CPU attention (flash kernel) with one combined mask; GQA without copies.

    A decode step (one query) with grouped kv heads runs as one query *block* per kv head: the
    `rep` query heads that share a kv head become `rep` query rows [B, Hkv, rep, D] over the same
    keys, which is the same attention (no causal mask among them at one position). The flash
    kernel then reads each kv head's keys once for `rep` rows instead of once per query head
    (measured: docs/performance.md, "Behind the code"). Sums run in
    another order than with enable_gqa, so results differ in the last bit (fp32 up to ~5e-7)."""
    if torch.compiler.is_compiling():  # traced: the reference's ops (see attention_ref)
        return attention_ref(q, k, v, scale=scale, mask=mask, causal=causal, bias=bias,
                             window=window)
    rep = _check_heads(q, k)
    attn_mask, is_causal, keep = _sdpa_mask(q, k, mask, causal, bias, window)
    b, hq, sq, d = q.shape
    if sq == 1 and rep > 1 and (attn_mask is None or (attn_mask.dim() == 4
                                                      and attn_mask.shape[1] in (1, hq))):
        hkv = k.shape[1]
        if attn_mask is not None:  # [B|1, Hq|1, 1, Sk] -> [B|1, Hkv|1, rep|1, Sk]
            mb, mh = attn_mask.shape[:2]
            attn_mask = (attn_mask.reshape(mb, 1, 1, -1) if mh == 1
                         else attn_mask.reshape(mb, hkv, rep, -1))
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, rep, d), k, v,
                                             attn_mask=attn_mask, scale=scale)
        out = out.reshape(b, hq, 1, out.shape[-1])
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                             scale=scale, enable_gqa=rep > 1)
    if keep is not None:  # rows with no attendable key: zeros (sdpa may give NaN there)
        out = out.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
              mask: torch.Tensor | None = None, causal: bool = False,
              bias: torch.Tensor | None = None, window: int | None = None,
              backend: str | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias, masked) v; q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D].
    softcap: scores soft-capped first (Gemma 2); sinks [Hq]: a per-head logit in each softmax's
    denominator (gpt-oss); both on the reference whatever the backend."""
    if softcap is not None or sinks is not None:
        return attention_ref(q, k, v, scale=scale, mask=mask, causal=causal, bias=bias,
                             window=window, softcap=softcap, sinks=sinks)
    fn = _dispatch.pick(backend, q.device, ref=attention_ref, triton_fn=attention_triton,
                        cpu_fn=attention_cpu)
    return fn(q, k, v, scale=scale, mask=mask, causal=causal, bias=bias, window=window)


class SlotRows:
    """Keys or values left where a paged KV cache stores them: they stand for the tensor
    [1, Hkv, K, D] whose key j is slot index[j] of `slots` [S, Hkv, D], the tensor that
    `slots.index_select(0, index)` (transposed) would copy out. `attention_segments` reads them
    in place: its native rows kernel through the index, other segments by `rows` of their own
    range only."""

    __slots__ = ("index", "slots")

    def __init__(self, slots: torch.Tensor, index: torch.Tensor):
        if slots.dim() != 3 or index.dim() != 1:
            raise ValueError(f"SlotRows: expected slots [S, Hkv, D] and a 1-D index, got "
                             f"{tuple(slots.shape)} and {tuple(index.shape)}")
        self.slots = slots
        self.index = index.to(torch.int64).contiguous()  # itself where it already is

    @property
    def shape(self) -> torch.Size:
        return torch.Size((1, self.slots.shape[1], self.index.numel(), self.slots.shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        return self.slots.dtype

    def rows(self, k0: int = 0, k1: int | None = None) -> torch.Tensor:
        """Keys k0:k1 as a tensor [1, Hkv, k1 - k0, D] (a gathered copy)."""
        picked = self.slots.index_select(0, self.index[k0:k1])
        return picked.transpose(0, 1).unsqueeze(0)


def attention_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       segments: list[tuple[int, int, int, int]], *, scale: float,
                       mask: torch.Tensor, backend: str | None = None,
                       softcap: float | None = None,
                       sinks: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` of packed requests, each over its own keys: q [1, Hq, T, D] holds the queries
    of several sequences one after another, k / v [1, Hkv, K, D] their keys, and `segments`
    (q0, q1, k0, k1) says that queries q0:q1 read only keys k0:k1 (mask [1, 1, T, K] masks every
    other key of those rows: the caller checked it). Each segment is one `attention` call with
    its block of the mask, so the work is the sum of the segments' q x k instead of T x K.
    Every query row must be in one segment.

    On the CPU path, the segments of one query (continuous batching's decode rows) are attended
    in one call of the native kernel (`attend_rows_native`) where it takes them (bf16, no
    sinks, a mask of keep / masked only), instead of one torch call per request.

    k and v may be SlotRows (both over one index tensor): keys left in a paged cache. The native
    kernel then reads them in place and each other segment gathers its own keys only.

    A segment whose block of the mask is the causal rule (query i of n sees its request's keys
    up to k1 - k0 - n + i: a prefill chunk after the request's earlier tokens) is attended with
    causal=True and no mask (`causal_segments`, checked once per forward): the same attention,
    to the bit (tests/kernels/test_attend_rows.py), without building an additive mask per call.
    out: the [1, Hq, T, D] tensor to write (any strides); by default a new one."""
    out = q.new_empty(q.shape) if out is None else out
    rest = segments
    if _dispatch.resolve(backend, q.device) == "cpu":
        plan = rows_plan(q, k, v, segments, mask, sinks)
        if plan is not None:
            spans, keep, rest = plan
            attend_rows_native(q, k, v, spans, keep, scale, softcap, out)
    in_slots = isinstance(k, SlotRows)
    causal = causal_segments(rest, mask)
    for (q0, q1, k0, k1), is_causal in zip(rest, causal, strict=True):
        ks, vs = (k.rows(k0, k1), v.rows(k0, k1)) if in_slots else (k[:, :, k0:k1], v[:, :, k0:k1])
        out[:, :, q0:q1] = attention(
            q[:, :, q0:q1], ks, vs, scale=scale,
            mask=None if is_causal else mask[..., q0:q1, k0:k1], causal=is_causal,
            backend=backend, softcap=softcap, sinks=sinks)
    return out


# The last (mask, segments) checked by causal_segments and its verdicts (as _last_plan).
_last_causal: tuple = (None, None, None)


def causal_segments(segments: list[tuple[int, int, int, int]], mask: torch.Tensor
                    ) -> list[bool]:
    """Per segment (q0, q1, k0, k1): True when its block of mask [1, 1, T, K] is exactly the
    causal rule of `attention` (query i of the n = q1 - q0 sees keys j <= (k1 - k0) - n + i; an
    additive mask 0 there, masked elsewhere), so that causal=True without the mask attends the
    same keys with the same scores. Checked once per forward: every layer gets the same mask and
    segments objects."""
    global _last_causal
    last = _last_causal
    if last[0] is mask and last[1] is segments:
        return last[2]
    found = [_is_causal_block(mask, *seg) for seg in segments]
    _last_causal = (mask, segments, found)
    return found


def _is_causal_block(mask: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> bool:
    n, m = q1 - q0, k1 - k0
    if mask.dim() != 4 or mask.shape[:2] != (1, 1) or n < 1 or m < n:
        return False
    block = mask[0, 0, q0:q1, k0:k1]
    rule = (torch.arange(m, device=mask.device)[None, :]
            <= torch.arange(n, device=mask.device)[:, None] + (m - n))
    if block.dtype == torch.bool:
        return bool(torch.equal(block, rule))
    masked = block <= torch.finfo(block.dtype).min
    return bool(torch.equal(~masked, rule) and (block[rule] == 0).all())


# The last (mask, segments) planned and its plan: every layer of a forward gets the same mask and
# segments objects (injection/paged.py), so the rows are planned once per forward. One tuple,
# read once and replaced whole (two managers' threads never see each other's halves).
_last_plan: tuple = (None, None, None)


def rows_plan(q, k, v, segments, mask, sinks):
    """(spans [n, 3] int64 of (t, k0, k1), keep [n, K] uint8 or None, the other segments) for
    the single-query segments the native kernel takes; None where it takes none of them."""
    kt, vt = (k.slots, v.slots) if isinstance(k, SlotRows) else (k, v)
    if (sinks is not None or torch.compiler.is_compiling() or q.device.type != "cpu"
            or not (q.dtype == k.dtype == v.dtype == torch.bfloat16)
            or q.shape[0] != 1 or q.shape[-1] % 32 or q.shape[-1] > NATIVE_ROWS_MAX_D
            or q.stride(-1) != 1 or kt.stride(-1) != 1 or vt.stride(-1) != 1
            or isinstance(k, SlotRows) != isinstance(v, SlotRows)
            or (isinstance(k, SlotRows) and k.index is not v.index)  # the kernel takes one
            or (torch.is_grad_enabled() and (q.requires_grad or kt.requires_grad
                                             or vt.requires_grad))
            or _native.lib() is None):
        return None
    global _last_plan
    last = _last_plan
    if last[0] is mask and last[1] is segments:
        return last[2]
    plan = _plan_rows(segments, mask)
    _last_plan = (mask, segments, plan)
    return plan


def _plan_rows(segments, mask):
    single = [seg for seg in segments if seg[1] - seg[0] == 1]
    if len(single) < 2 or mask.dim() != 4 or mask.shape[:2] != (1, 1):
        return None
    spans = torch.tensor([(q0, k0, k1) for q0, _, k0, k1 in single], dtype=torch.int64)
    block = mask[0, 0, spans[:, 0]]  # [n, K]
    if block.dtype == torch.bool:
        keep = block
    else:  # 0 (attend) or "masked" only: a bias the kernel does not add
        masked = block <= torch.finfo(block.dtype).min
        if not bool(((block == 0) | masked).all()):
            return None
        keep = ~masked
    # the kernel reads keep only inside each row's span: None where no key in a span is masked
    # (continuous batching: the other requests' keys are masked, and only they)
    keys = torch.arange(keep.shape[-1])
    inside = (keys >= spans[:, 1:2]) & (keys < spans[:, 2:3])
    keep = None if bool((keep | ~inside).all()) else keep.to(torch.uint8).contiguous()
    rest = [seg for seg in segments if seg[1] - seg[0] != 1]
    return spans, keep, rest


# head_dim the native rows take (csrc/cpu_decode.c: MAX_D)
NATIVE_ROWS_MAX_D = 256


def attend_rows_native(q, k, v, spans, keep, scale, softcap, out) -> None:
    """out[0, :, t] = attention of q[0, :, t] over keys k0:k1 of k / v (tensors, or SlotRows
    over one index, read in place) for each (t, k0, k1) of spans, by the native kernel
    (csrc/cpu_decode.c: hfd_attend_rows, the numerics of the native decode layer's attention:
    torch's CPU flash attention's without a soft-cap, the torch path's eager ones with it)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    slots = None
    if isinstance(k, SlotRows):  # slots [S, Hkv, D]: kv head stride 1, key stride 0
        slots, index = (k.slots, v.slots), k.index
        kp, khs, kss = slots[0].data_ptr(), slots[0].stride(1), slots[0].stride(0)
        vp, vhs, vss = slots[1].data_ptr(), slots[1].stride(1), slots[1].stride(0)
    else:
        kp, khs, kss = k.data_ptr(), k.stride(1), k.stride(2)
        vp, vhs, vss = v.data_ptr(), v.stride(1), v.stride(2)
    code = _native.lib().hfd_attend_rows(
        q.data_ptr(), q.stride(1), q.stride(2), kp, khs, kss, vp, vhs, vss, spans.data_ptr(),
        spans.shape[0], hq, hkv, d, None if keep is None else keep.data_ptr(),
        0 if keep is None else keep.stride(0), float(scale), float(softcap or 0.0),
        out.data_ptr(), out.stride(1), out.stride(2),
        None if slots is None else index.data_ptr(), torch.get_num_threads())
    _native.check(code, "hfd_attend_rows")
