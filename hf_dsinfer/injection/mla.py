"""Multi-head latent attention inside a FusedBlock (DeepSeek-V2 / V3): the attention option for blocks
whose policy has an `MlaLayout`.

The attention module keeps its class and parameters; this computes its forward from them with
kernels ops: the low-rank query (q_a_proj -> RMSNorm -> q_b_proj, or one q_proj), the joint
KV down-projection `kv_a_proj_with_mqa` split into the latent (RMS-normalized) and the shared
rotary key, RoPE on the rotary dims only (DeepSeek's interleaved pairs are de-interleaved first,
as HF's apply_rotary_pos_emb_interleave leaves them), then the HF `Cache` update with the latent
and the rotary key, exactly the tensors HF caches: the cache stays an HF Cache of HF's shapes,
[B, 1, S, r] and [B, 1, S, dr], so a fallback, a crop, beams or a static cache see what HF
would. Attention then runs over the cached latent: expanded per head for a prefill (HF's order),
absorbed (kernels.mla) for decode steps, which read the latent as stored.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_dsinfer.hf import cache_args
from hf_dsinfer.injection import policy as P
from hf_dsinfer.kernels.mla import mla_attention_absorbed, mla_attention_expanded
from hf_dsinfer.kernels.rotary import apply_rotary

if TYPE_CHECKING:
    from hf_dsinfer.injection.fused import FusedBlock


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """An MlaLayout resolved against one attention module."""

    num_heads: int
    nope_dim: int  # dn: per-head query / key dims without positions
    rope_dim: int  # dr: rotary dims (query per head, key shared)
    v_dim: int  # dv
    latent_dim: int  # r: kv_lora_rank
    low_rank_q: bool  # q_a_proj -> norm -> q_b_proj (else one q_proj)
    rope_interleave: bool

    def describe(self) -> str:
        q = "low-rank q" if self.low_rank_q else "q_proj"
        return (f"MLA: {self.num_heads} heads, latent {self.latent_dim} + rope {self.rope_dim}, "
                f"{q}, absorbed decode")


def resolve_mla_spec(attn: nn.Module, layout: P.MlaLayout, config: Any) -> MlaSpec:
    kv_b = attn.get_submodule(layout.kv_b_proj)
    kv_a_norm = attn.get_submodule(layout.kv_a_norm)
    latent = int(kv_a_norm.weight.shape[0])
    rope = int(attn.get_submodule(layout.kv_a_proj).out_features) - latent
    v_dim = int(getattr(attn, layout.v_dim_attr))
    nope = int(getattr(attn, layout.nope_dim_attr))
    # heads follow kv_b_proj's rows (per head [k_nope | v]): this rank's heads when tensor
    # parallelism sliced it, where the module's num_heads attribute still counts all heads
    num_heads = int(kv_b.weight.shape[0]) // (nope + v_dim)
    if num_heads * (nope + v_dim) != kv_b.weight.shape[0] or \
            num_heads > int(getattr(attn, layout.num_heads_attr)):
        raise ValueError(f"{type(attn).__name__}.{layout.kv_b_proj}: expected whole heads of "
                         f"{nope} + {v_dim} rows, got {kv_b.weight.shape[0]} rows")
    return MlaSpec(num_heads=num_heads, nope_dim=nope, rope_dim=rope, v_dim=v_dim,
                   latent_dim=latent, low_rank_q=getattr(attn, layout.q_a_proj, None) is not None,
                   rope_interleave=bool(P.resolve(layout.rope_interleave, config)))


class MlaAttention:
    """The attention step of a FusedBlock whose policy has an MlaLayout."""

    def __init__(self, fused: FusedBlock, layout: P.MlaLayout, spec: MlaSpec):
        self.fused = fused
        self.layout = layout
        self.spec = spec
        self.absorbed_calls = 0  # decode steps over the latent as stored (tests count them)

    def linear_names(self) -> tuple[str, ...]:
        """The attention's linears a weight-only quantization replaces: all but kv_b_proj,
        whose weight the absorbed decode reads as two matrices (W_uk, W_uv)."""
        lay = self.layout
        q = (lay.q_a_proj, lay.q_b_proj) if self.spec.low_rank_q else (lay.q_proj,)
        return (*q, lay.kv_a_proj, self.fused.policy.out_proj)

    def __call__(self, x: torch.Tensor, named: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, H] (normed) -> (attention output projected [B, S, H], o_proj bias)."""
        fused, spec, attn = self.fused, self.spec, self.fused._attn
        b, s, _ = x.shape
        q = self._query(x).view(b, s, spec.num_heads, -1).transpose(1, 2)  # [B, nh, S, dn + dr]
        q_nope, q_rot = q.split([spec.nope_dim, spec.rope_dim], dim=-1)
        kv, k_rot = fused._linear(attn.get_submodule(self.layout.kv_a_proj), x).split(
            [spec.latent_dim, spec.rope_dim], dim=-1)
        kv = self._norm(self.layout.kv_a_norm, kv).view(b, 1, s, spec.latent_dim)
        k_rot = k_rot.reshape(b, 1, s, spec.rope_dim)
        q_rot, k_rot = self._rotate(q_rot, k_rot, named)
        cache = cache_args.dense_cache(named, fused.policy.cache_arg)
        if cache is not None:  # HF caches the latent and the rotary key, [B, 1, S, r | dr]
            kv, k_rot = cache.update(kv, k_rot, fused.spec.layer_idx)
        mask = named.get("attention_mask")
        if mask is None and s > 1 and kv.shape[2] > s:  # as FusedBlock._attend
            kv, k_rot = kv[:, :, :s], k_rot[:, :, :s]
        absorbed = s == 1
        op = mla_attention_absorbed if absorbed else mla_attention_expanded
        out = op(q_nope, q_rot, kv, k_rot, attn.get_submodule(self.layout.kv_b_proj).weight,
                 dv=spec.v_dim, scale=fused.spec.scale, mask=mask, causal=mask is None and s > 1,
                 backend=fused.backend)  # [B, nh, S, dv]
        if absorbed and not torch.compiler.is_compiling():
            self.absorbed_calls += 1
        return fused._project_out(out, b, s)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        attn, lay, fused = self.fused._attn, self.layout, self.fused
        if not self.spec.low_rank_q:
            return fused._linear(attn.get_submodule(lay.q_proj), x)
        q_a = self._norm(lay.q_a_norm, fused._linear(attn.get_submodule(lay.q_a_proj), x))
        return fused._linear(attn.get_submodule(lay.q_b_proj), q_a)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.fused._norm(self.fused._attn.get_submodule(name), x)

    def _rotate(self, q_rot: torch.Tensor, k_rot: torch.Tensor, named: dict):
        """RoPE on the rotary dims. Interleaved pairs (x0, x1), (x2, x3) ... are first laid out
        as [evens | odds], then rotated by the rotate-half rule: HF's interleaved variant's
        output, order of dims included (the cache holds rotated keys). DeepSeek-V2's complex
        rotation is its apply_rotary_emb op for op (fp32 complex products, one rounding)."""
        if self.layout.rope_complex:  # DeepSeek-V2: pairs times freqs_cis [B, S, dr / 2]
            freqs = named["position_embeddings"].unsqueeze(1)
            return tuple(torch.view_as_real(torch.view_as_complex(
                t.float().reshape(*t.shape[:-1], -1, 2)) * freqs).flatten(3).type_as(t)
                for t in (q_rot, k_rot))
        cos, sin = named["position_embeddings"]
        if self.spec.rope_interleave:
            q_rot, k_rot = (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
                            for t in (q_rot, k_rot))
        return apply_rotary(q_rot, k_rot, cos, sin, backend=self.fused.backend)
