"""Multi-head latent attention (DeepSeek-V2/V3): attention over a compressed, shared KV latent.

Each token's keys and values are cached as one latent `kv [B, 1, Sk, r]` (RMS-normalized) plus
one rotary key `k_rot [B, 1, Sk, dr]` shared by all heads. Per head h, the up-projection
`kv_b_proj` (weight [nh * (dn + dv), r], viewed as [nh, dn + dv, r]) makes its no-position key
`k_nope = kv @ W_uk[h]^T` (W_uk = rows :dn) and its value `v = kv @ W_uv[h]^T` (rows dn:). The
query of head h is [q_nope (dn) | q_rot (dr)]; scores are q_nope.k_nope + q_rot.k_rot, scaled.

Two ways to compute the same attention (equal up to the order of fp32 sums):

mla_attention_expanded(q_nope, q_rot, kv, k_rot, w_kv_b, ...) -> [B, nh, Sq, dv]
    HF's: up-project the whole cached latent to per-head keys and values, then attention with
    nh KV heads. Costs Sk * r * nh * (dn + dv) multiply-adds per call: the right order for a
    prefill, where every key is new anyway.
mla_attention_absorbed(...) -> [B, nh, Sq, dv]
    W_uk absorbed into the query (`q_lat = q_nope @ W_uk[h]`, [B, nh, Sq, r]) and W_uv applied
    after the attention: one KV head whose keys are [kv | k_rot] and whose values are kv itself,
    so the cache is read as stored and never expanded. Costs Sq * nh * r * (dn + dv) for the
    projections, independent of the cache length: the decode form (DeepSeek-V2, section 2.1.2).

Both call kernels.attention (softmax in fp32, masks, causal rule, empty rows zeroed), so the
dispatcher's CPU / Triton / reference paths apply. In half precision each rounds where its own
op order rounds (the absorbed form does not round k_nope / v): the bf16 tolerance applies.
"""

from __future__ import annotations

import torch

from hf_dsinfer.kernels.attention import attention


def _split_kv_b(w_kv_b: torch.Tensor, num_heads: int, dn: int, dv: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [nh * (dn + dv), r] -> (W_uk [nh, dn, r], W_uv [nh, dv, r]) views."""
    w = w_kv_b.view(num_heads, dn + dv, w_kv_b.shape[-1])
    return w[:, :dn], w[:, dn:]


def mla_attention_expanded(q_nope: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor,
                           k_rot: torch.Tensor, w_kv_b: torch.Tensor, *, dv: int, scale: float,
                           mask: torch.Tensor | None = None, causal: bool = False,
                           backend: str | None = None) -> torch.Tensor:
    """q_nope [B, nh, Sq, dn], q_rot [B, nh, Sq, dr], kv [B, 1, Sk, r], k_rot [B, 1, Sk, dr],
    w_kv_b [nh * (dn + dv), r] -> [B, nh, Sq, dv], with HF's op order (DeepseekV3Attention)."""
    b, nh, _, dn = q_nope.shape
    sk = kv.shape[2]
    kv_heads = torch.nn.functional.linear(kv, w_kv_b)  # [B, 1, Sk, nh * (dn + dv)]
    kv_heads = kv_heads.view(b, sk, nh, dn + dv).transpose(1, 2)  # [B, nh, Sk, dn + dv]
    k_nope, v = kv_heads.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, nh, -1, -1)], dim=-1)  # [B, nh, Sk, dn + dr]
    q = torch.cat([q_nope, q_rot], dim=-1)
    return attention(q, k, v, scale=scale, mask=mask, causal=causal, backend=backend)


def mla_attention_absorbed(q_nope: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor,
                           k_rot: torch.Tensor, w_kv_b: torch.Tensor, *, dv: int, scale: float,
                           mask: torch.Tensor | None = None, causal: bool = False,
                           backend: str | None = None) -> torch.Tensor:
    """The same attention over the latent as stored: shapes as mla_attention_expanded."""
    nh, dn = q_nope.shape[1], q_nope.shape[3]
    w_uk, w_uv = _split_kv_b(w_kv_b, nh, dn, dv)
    q_lat = torch.matmul(q_nope, w_uk)  # [B, nh, Sq, r]: q_nope @ W_uk[h] per head
    q = torch.cat([q_lat, q_rot], dim=-1)  # [B, nh, Sq, r + dr]
    k = torch.cat([kv, k_rot], dim=-1)  # [B, 1, Sk, r + dr]: one KV head for all nh
    o_lat = attention(q, k, kv, scale=scale, mask=mask, causal=causal, backend=backend)
    return torch.matmul(o_lat, w_uv.transpose(1, 2))  # [B, nh, Sq, dv]
