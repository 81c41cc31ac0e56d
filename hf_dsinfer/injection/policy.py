"""Injection policies: per-family *data* saying how an HF decoder block is laid out.

A policy names the HF classes it matches, where the decoder blocks live, which submodule is
which (HF attribute names kept verbatim), how Q/K/V are packed, where positions come from, and
how the residual stream is wired. `FusedBlock` (fused.py) reads a policy plus the block's own
tensors and computes the block with `hf_dsinfer.kernels` ops. Adding a family is adding one
small file under `policies/` and listing it in `policies/__init__.py`.

Values that depend on a model's config (GPT-NeoX's parallel residual, OPT's post-LN variant,
the activation name) are given as `FromConfig(attr, mapping)` instead of code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_dsinfer.errors import PolicyError
from hf_dsinfer.hf import cache_args


@dataclasses.dataclass(frozen=True)
class FromConfig:
    """A policy value read from the model config: `mapping[config.<attr>]` (or the raw value).

    `attr` may name several attributes: the mapping's keys are then tuples of their values
    (Falcon's block wiring follows three config flags)."""

    attr: str | tuple[str, ...]
    mapping: dict[Any, Any] | None = None
    default: Any = None

    def resolve(self, config: Any) -> Any:
        if isinstance(self.attr, tuple):
            value = tuple(getattr(config, a, self.default) for a in self.attr)
        else:
            value = getattr(config, self.attr, self.default)
        if self.mapping is None:
            return value
        if value not in self.mapping:
            raise PolicyError(
                f"config {self.attr} = {value!r}: the policy maps only {list(self.mapping)} "
                "(a combination transformers' own modeling code does not build either, or one "
                "this family's policy does not describe yet)")
        return self.mapping[value]


def resolve(value: Any, config: Any) -> Any:
    return value.resolve(config) if isinstance(value, FromConfig) else value


@dataclasses.dataclass(frozen=True)
class FromBlock:
    """A policy value read from each decoder block: `block.<attr>` (MiniCPM3's layers compute
    their residual scale, scale_depth / sqrt(num_hidden_layers), in __init__)."""

    attr: str


def resolve_in_block(value: Any, config: Any, block: Any) -> Any:
    """resolve(), where a FromBlock reads the block's attribute."""
    return getattr(block, value.attr) if isinstance(value, FromBlock) else resolve(value, config)


# Q/K/V layouts.
SEPARATE = "separate"        # q_proj, k_proj, v_proj: three nn.Linear
PACKED = "packed"            # one projection whose output is [q | k | v] (GPT-2's Conv1D c_attn)
GROUPED_GQA = "grouped_gqa"  # one projection whose output is per KV head [q x (heads / KV
                             # heads), k, v] (Falcon's `query_key_value`: one group with
                             # multi_query; a group per head, [q, k, v] per head, without it,
                             # as GPT-NeoX's and BLOOM's)
PACKED_GQA = "packed_gqa"    # one projection whose output is [q | k | v], q of
                             # config.num_attention_heads heads, k and v of
                             # config.num_key_value_heads each (Phi-3's `qkv_proj`)

# Residual wiring.
SEQUENTIAL = "sequential"    # x + attn(ln1(x)) -> h; h + mlp(ln2(h))            (pre-LN)
PARALLEL = "parallel"        # x + attn(ln1(x)) + mlp(ln2(x))                     (GPT-NeoX)
PARALLEL_SHARED_LN = "parallel_shared_ln"  # x + attn(ln1(x)) + mlp(ln1(x))      (GPT-J)
POST_LN = "post_ln"          # h = ln1(x + attn(x)); ln2(h + mlp(h))              (OPT-350m)
SANDWICH = "sandwich"        # h = x + pn1(attn(ln1(x))); h + pn2(mlp(ln2(h))), where ln1 / ln2
                             # (pre-norms) may be None (OLMo 2) and pn1 / pn2 are the policy's
                             # post_attn_norm / post_mlp_norm                    (Gemma 2/3)

# RMSNorm numerics (policy.norm): where the weight multiply happens (kernels.norms styles).
RMS = "rms"                  # Llama: normalized value rounded to the input dtype, then * weight
RMS_FP32 = "rms_fp32"        # OLMo 2: (weight * normalized) in fp32, then rounded
RMS_UNIT_OFFSET = "rms_unit_offset"  # Gemma: (normalized * (1 + weight)) in fp32, then rounded
RMS_STYLES = {RMS: "llama", RMS_FP32: "fp32", RMS_UNIT_OFFSET: "gemma"}
# LayerNorm numerics: "layer" is torch's nn.LayerNorm; LAYER_FP32 is Cohere's (no bias, the
# weight multiply in fp32, kernels.norms.layer_norm_fp32)
LAYER = "layer"
LAYER_FP32 = "layer_fp32"
LAYER_1P = "layer_1p"        # Nemotron's LayerNorm1P: nn.LayerNorm with the weight read as 1 + w
LAYER_PLAIN = "layer_plain"  # OLMo's LayerNorm: no weight or bias, in fp32, rounded once
                             # (kernels.norms.layer_norm_plain)

# Position sources.
ROPE = "rope"                # (cos, sin) passed to the block as `position_embeddings`
ROPE_TABLE = "rope_table"    # GPT-J: interleaved sin / cos (policies/gptj.py: where they come from)
ALIBI = "alibi"              # BLOOM: `alibi` argument [B * H, 1, S_k]
NO_POSITIONS = "none"        # learned absolute positions added before the blocks

# q/k normalization inside attention (RMSNorm modules `q_norm` / `k_norm` on the attention).
QK_NORM_HEAD = "per_head"    # Qwen3(-MoE): over each head's head_dim, before RoPE
QK_NORM_FULL = "full"        # OLMoE: over the whole q (k) projection, before the head split
QK_NORM_MODULE = "module"    # the attention's own q / k norm modules, called on the heads as HF
                             # calls them (LayerNorms: Phi's shared one, StableLM's one per head,
                             # Cohere's [heads, head_dim] weight), before RoPE

QKV_LAYOUTS = (SEPARATE, PACKED, PACKED_GQA, GROUPED_GQA)
LAYOUTS = (SEQUENTIAL, PARALLEL, PARALLEL_SHARED_LN, POST_LN, SANDWICH)
NORMS = (LAYER, LAYER_FP32, LAYER_1P, LAYER_PLAIN, *RMS_STYLES)
POSITIONS = (ROPE, ROPE_TABLE, ALIBI, NO_POSITIONS)
QK_NORMS = (None, QK_NORM_HEAD, QK_NORM_FULL, QK_NORM_MODULE)
TP_STYLES = ("colwise", "rowwise")
SCORINGS = ("softmax", "sigmoid_group", "softmax_biased", "softmax_group")


def _choices(value: Any) -> list:
    """The values a policy field may take: its own, or those a FromConfig maps to."""
    if isinstance(value, FromConfig):
        return list(value.mapping.values()) if value.mapping else []
    return [value]


def _check_choice(where: str, field: str, value: Any, allowed: tuple) -> None:
    """`value` (or every value a FromConfig maps to) must be one of `allowed`."""
    for v in _choices(value):
        if v not in allowed:
            raise PolicyError(f"{where}: {field}={v!r} is not one of {list(allowed)}. Fix: use "
                              "one of the constants of hf_dsinfer.injection.policy.")


def _check_names(where: str, field: str, value: Any, *, empty: bool = False) -> None:
    """A tuple of attribute names (non-empty unless `empty`)."""
    if (not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value)
            or (not value and not empty)):
        raise PolicyError(f"{where}: {field} must be a {'' if empty else 'non-empty '}tuple of "
                          f"attribute names, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """A sparse mixture-of-experts MLP (transformers 5's fused 3-D expert tensors
    `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) and how it routes.
    Layers whose MLP is not one of `classes` (Qwen2/3-MoE's `mlp_only_layers`, between
    `decoder_sparse_step`s) are dense MLPs read through the policy's mlp_in / mlp_out."""

    classes: tuple[str, ...]              # HF sparse-MoE module class names
    num_experts: str                      # config attribute holding E
    top_k: str = "num_experts_per_tok"    # config attribute holding k
    top_k_module: str | None = None       # else a dotted path under the MoE module holding it
                                          # (HunYuan's router resolves a per-layer moe_topk)
    renormalize: Any = True               # divide the top-k probs by their sum (or FromConfig)
    fp32_weights: bool = False            # routing weights stay fp32 (Mixtral); else they are
                                          # cast to the router logits' dtype (Qwen2/3-MoE, OLMoE)
    router: str = "gate"                  # Linear-like module with `weight [E, H]`
    router_linear: str | None = None      # or a dotted path under it to that Linear (HunYuan's
                                          # gate.wg; HF records router logits on the router)
    router_args: tuple[str, ...] = ()     # what HF's MoE passes its router after the hidden
                                          # states (dotted paths under the MoE module;
                                          # MiniMax-M2: its correction bias)
    experts: str = "experts"
    shared_expert: str | None = None      # Qwen2-MoE: dense gated MLP (mlp_in / mlp_out names)
    shared_expert_gate: str | None = None  # its sigmoid gate, Linear(H, 1); None: ungated
                                          # (DeepSeek-V3's shared experts)
    softmax_first: bool = True            # False: top-k of the router logits, then a softmax
                                          # over those k (gpt-oss). A router `bias` is added.
    # The experts' form (kernels.expert_forms), beyond the canonical [gate | up] nn.Linear one:
    experts_transposed: bool = False      # gate_up_proj [E, H, 2I], down_proj [E, I, H]
    gate_up_interleaved: bool = False     # gate / up columns alternate (g0, u0, g1, u1 ...)
    expert_bias: bool = False             # experts.gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
    swiglu_alpha: Any = None              # clamped SwiGLU (gpt-oss): FromConfig of alpha, limit
    swiglu_limit: Any = None
    returns_scores: bool = False          # the MoE module returns (hidden, router scores)
    # DeepSeek-V3's router (kernels.moe_routing): "sigmoid_group" = sigmoid scores, a
    # correction bias (router buffer) steering the choice, top-k within the topk_group best of
    # n_group groups, weights times routed_scaling; its router GEMM runs in fp32.
    # "softmax_biased" (ERNIE 4.5): fp32 softmax, the choice by the probabilities plus the
    # correction bias, the chosen probabilities renormalized by max(sum, norm_min), then cast
    # to the activations' dtype.
    # "softmax_group" (DeepSeek-V2): fp32 softmax, top-k within the topk_group groups of the
    # best single probabilities (where group_limited; else over every expert), weights times
    # routed_scaling, no correction bias.
    scoring: str = "softmax"
    group_limited: Any = True             # softmax_group: groups apply (FromConfig of
                                          # DeepSeek-V2's topk_method), else one group
    correction_bias: str | None = None    # a dotted path under the MoE module (DeepSeek-V3:
                                          # "gate.e_score_correction_bias"; MiniMax-M2: on the block)
    norm_min: Any = None                  # softmax_biased: the renormalization's floor
    n_group: Any = None                   # FromConfig
    topk_group: Any = None
    routed_scaling: Any = None
    router_fp32: bool = False

    def __post_init__(self) -> None:
        _check_names("MoeLayout", "classes", self.classes)
        _check_names("MoeLayout", "router_args", self.router_args, empty=True)
        for field in ("top_k_module", "router_linear", "correction_bias"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise PolicyError(f"MoeLayout: {field} must be a dotted attribute path or None, "
                                  f"got {value!r}")
        for field in ("num_experts", "top_k", "router", "experts"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise PolicyError(f"MoeLayout: {field} must be a config / module attribute "
                                  f"name, got {getattr(self, field)!r}")
        if self.shared_expert_gate is not None and self.shared_expert is None:
            raise PolicyError("MoeLayout: shared_expert_gate without a shared_expert")
        _check_choice("MoeLayout", "scoring", self.scoring, SCORINGS)
        if self.scoring in ("sigmoid_group", "softmax_biased") and self.correction_bias is None:
            raise PolicyError(f"MoeLayout: scoring={self.scoring!r} reads a correction_bias "
                              "(the router attribute holding it)")


@dataclasses.dataclass(frozen=True)
class MlaLayout:
    """Multi-head latent attention (DeepSeek-V2/V3, injection.mla): the attention module's
    submodule and attribute names (HF's, verbatim)."""

    q_proj: str = "q_proj"                # the full-rank query, when q_a_proj is None
    q_a_proj: str = "q_a_proj"            # low-rank query: q_b_proj(norm(q_a_proj(x)))
    q_a_norm: str = "q_a_layernorm"
    q_b_proj: str = "q_b_proj"
    kv_a_proj: str = "kv_a_proj_with_mqa"  # x -> [latent r | shared rotary key dr]
    kv_a_norm: str = "kv_a_layernorm"
    kv_b_proj: str = "kv_b_proj"          # latent -> per head [k_nope dn | v dv]
    num_heads_attr: str = "num_heads"     # attention attribute
    v_dim_attr: str = "v_head_dim"        # attention attribute
    nope_dim_attr: str = "qk_nope_head_dim"  # attention attribute
    rope_interleave: Any = False          # rotary dims in interleaved pairs (FromConfig)
    rope_complex: bool = False            # position_embeddings is DeepSeek-V2's complex freqs_cis
                                          # [B, S, dr / 2]: pairs rotated in fp32 as complex
                                          # products, kept interleaved, rounded once

    def __post_init__(self) -> None:
        for field in ("q_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm",
                      "kv_b_proj", "num_heads_attr", "v_dim_attr", "nope_dim_attr"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise PolicyError(f"MlaLayout: {field} must be a module / attribute name, got "
                                  f"{getattr(self, field)!r}")


@dataclasses.dataclass(frozen=True)
class Policy:
    family: str
    model_types: tuple[str, ...]          # config.model_type values this policy covers
    block_classes: tuple[str, ...]        # HF decoder-block class names it fuses
    layers: str                           # dotted path from the *ForCausalLM to the block list
    layout: Any                           # SEQUENTIAL / PARALLEL / ... or FromConfig
    norm: str                             # "layer", or an RMSNorm kind: RMS / RMS_FP32 / ...
    ln1: Any                              # attribute names inside the block (pre-norms),
    ln2: Any                              # or FromConfig (Falcon: by its wiring)
    attn: str
    qkv_layout: str
    qkv: tuple[str, ...]                  # ("q_proj", "k_proj", "v_proj") or ("c_attn",)
    out_proj: str
    mlp: str | None                       # submodule holding the MLP linears ("" = the block)
    mlp_in: tuple[str, ...]               # (fc1,) or (gate, up) for gated MLPs; one name for
                                          # a gated MLP: its output is [gate | up] (Phi-3)
    mlp_out: str
    activation: Any                       # HF activation name, or FromConfig
    gated: bool = False
    positions: str = NO_POSITIONS
    rotary_interleaved: bool = False
    conv1d: bool = False                  # weights stored [in, out] (transformers' Conv1D)
    scale_attr: str = "scaling"           # attention-module attribute holding the softmax scale
    scale_inverted: bool = False          # GPT-J stores sqrt(head_dim): scale = 1 / value
    scale_query: bool = False             # OPT multiplies q by the scale before QK^T
    residual_post_ln: Any = False         # BLOOM's apply_residual_connection_post_layernorm
    # block-forward argument carrying the HF Cache (hf.cache_args: the installed release's name;
    # a block call is also searched under the names other releases use)
    cache_arg: str = cache_args.KEYWORD
    returns_tuple: bool = False           # block returns (hidden_states, attn_weights)
    # Tensor parallelism: block-relative linear path -> "colwise" / "rowwise". None: take it
    # from the HF config's `base_model_tp_plan` (families transformers already has a plan for).
    tp_plan: dict[str, str] | None = None
    qk_norm: str | None = None            # QK_NORM_HEAD / QK_NORM_FULL
    qk_norm_attrs: tuple[str, str] = ("q_norm", "k_norm")  # the attention's norm modules
    qk_norm_heads_first: bool = False     # QK_NORM_MODULE: the modules take [B, heads, S, D]
                                          # (Phi, StableLM), not [B, S, heads, D] (Cohere)
    qk_norm_after_rope: bool = False      # per-head q / k norms of the rotated q, k (HunYuan),
                                          # not before RoPE (Qwen3)
    clip_qkv: Any = None                  # OLMoE: clamp q, k, v to +-clip_qkv (FromConfig)
    moe: MoeLayout | None = None          # the MLP is (sometimes) a sparse MoE block
    moe_shared_mlp: str | None = None     # a block attribute holding an MLP module that HF adds
                                          # to the MoE's output (Granite MoE shared: shared_mlp,
                                          # None where shared_intermediate_size is 0), called
                                          # as HF calls it; whole on every tensor-parallel rank
    # Model features beyond Llama's block, each an option computed by the one FusedBlock:
    post_attn_norm: str | None = None     # SANDWICH: norm of the attention output (block attr)
    post_mlp_norm: str | None = None      # SANDWICH: norm of the MLP output (block attr)
    rope_attr: str | None = None          # attention attribute, false on NoPE layers (SmolLM3)
    softcap_attr: str | None = None       # attention attribute: tanh cap of the attention
                                          # logits, or None on the module (Gemma 2)
    residual_multiplier: Any = None       # attention / MLP outputs scaled before the residual
                                          # add (Granite: FromConfig; MiniCPM3: FromBlock)
    rope_half_table: bool = False         # cos / sin hold the D/2 frequencies once (gpt-oss),
                                          # not cat(freqs, freqs): rotate-half over all of D
    rope_pairs_table: bool = False        # HF's cos / sin are Llama's cat(freqs, freqs), read
                                          # as freqs.repeat_interleave(2) for interleaved pairs
                                          # (ERNIE 4.5, Helium, GLM; with rotary_interleaved)
    rope_optional: bool = False           # the model passes position_embeddings=None to its
                                          # NoPE layers (Granite SWA: a RoPE base of 0), which
                                          # then rotate nothing, as HF's attention does
    sliding_attr: str | None = None       # attention attribute, true on sliding layers: the
                                          # attention's sliding_window applies there only
                                          # (EXAONE 4 sets sliding_window on every layer)
    rope_sliding_only: bool = False       # with a window configured (the attention's
                                          # sliding_window set), only sliding layers rotate
                                          # q and k; global layers are NoPE (EXAONE 4)
    rope_fp32_math: bool = False          # q and k rotate in fp32 (cast before the products,
                                          # rounded once) whatever the tables' dtype (Cohere)
    parallel_residual_first: bool = False  # PARALLEL_SHARED_LN summed as (x + attn) + mlp
                                          # (Cohere), not (attn + mlp) + x (GPT-J)
    # (config attribute, value, what the fused block lacks for it): a model whose config has
    # that value is refused with the reason (Cohere's use_qk_norm: per-head norm weights)
    unsupported_when: tuple[tuple[str, Any, str], ...] = ()
    activation_module: str | None = None  # a plain MLP's activation as its own module under
                                          # the MLP, called as HF calls it (Apertus's xIELU
                                          # has learned parameters); `activation` is then unread
    norm_eps: float | None = None         # the epsilon of norm modules that keep none (OLMo's
                                          # LayerNorm hard-codes 1e-5)
    mla: MlaLayout | None = None          # the attention is multi-head latent attention
    sinks_attr: str | None = None         # attention parameter [heads]: a learned logit per
                                          # head in each softmax's denominator (gpt-oss)
    notes: str = ""

    def __post_init__(self) -> None:
        """Validate the data when the policy is defined (at import): a typo in a family file
        fails there, naming the field, instead of at the first forward."""
        where = f"policy {self.family!r}"
        if not isinstance(self.family, str) or not self.family:
            raise PolicyError(f"policy: family must be a non-empty name, got {self.family!r}")
        _check_names(where, "model_types", self.model_types)
        _check_names(where, "block_classes", self.block_classes)
        _check_choice(where, "layout", self.layout, LAYOUTS)
        _check_choice(where, "norm", self.norm, NORMS)
        _check_choice(where, "qkv_layout", self.qkv_layout, QKV_LAYOUTS)
        _check_choice(where, "positions", self.positions, POSITIONS)
        _check_choice(where, "qk_norm", self.qk_norm, QK_NORMS)
        if self.mla is not None:  # multi-head latent attention names its own projections
            if self.qkv:
                raise PolicyError(f"{where}: with mla, qkv must be () (MlaLayout names the "
                                  f"projections), got {self.qkv}")
            if not isinstance(self.mla, MlaLayout):
                raise PolicyError(f"{where}: mla must be an MlaLayout, got "
                                  f"{type(self.mla).__name__}")
        else:
            _check_names(where, "qkv", self.qkv)
        want = 0 if self.mla is not None else 3 if self.qkv_layout == SEPARATE else 1
        if len(self.qkv) != want:
            raise PolicyError(f"{where}: qkv_layout={self.qkv_layout!r} reads {want} "
                              f"projection(s), but qkv names {len(self.qkv)}: {self.qkv}")
        _check_names(where, "mlp_in", self.mlp_in, empty=self.moe is not None)
        if self.mlp_in and len(self.mlp_in) > (2 if self.gated else 1):
            raise PolicyError(f"{where}: mlp_in names {len(self.mlp_in)} projections: "
                              f"{self.mlp_in}; a {'gated' if self.gated else 'plain'} MLP reads "
                              f"at most {2 if self.gated else 1}")
        sandwich = self.layout == SANDWICH
        for field in ("post_attn_norm", "post_mlp_norm"):
            if sandwich and not getattr(self, field):
                raise PolicyError(f"{where}: layout=SANDWICH needs {field}")
            if getattr(self, field) and not sandwich and not isinstance(self.layout, FromConfig):
                raise PolicyError(f"{where}: {field} is only read by layout=SANDWICH, not "
                                  f"{self.layout!r}")
        if self.ln1 is None and not sandwich:
            raise PolicyError(f"{where}: ln1=None (no pre-norm) only with layout=SANDWICH")
        if self.qk_norm_heads_first and QK_NORM_MODULE not in _choices(self.qk_norm):
            raise PolicyError(f"{where}: qk_norm_heads_first lays out the heads for the q / k "
                              f"norm modules: it needs qk_norm=QK_NORM_MODULE, got "
                              f"{self.qk_norm!r}")
        if self.qk_norm_after_rope and self.qk_norm != QK_NORM_HEAD:
            raise PolicyError(f"{where}: qk_norm_after_rope norms each rotated head: it needs "
                              f"qk_norm=QK_NORM_HEAD, got {self.qk_norm!r}")
        if self.qk_norm is not None:
            _check_names(where, "qk_norm_attrs", self.qk_norm_attrs)
            if len(self.qk_norm_attrs) != 2:
                raise PolicyError(f"{where}: qk_norm_attrs names the q and the k norm, got "
                                  f"{self.qk_norm_attrs}")
        if self.rope_pairs_table and not (self.rotary_interleaved and self.positions == ROPE):
            raise PolicyError(f"{where}: rope_pairs_table reads HF's cos / sin for interleaved "
                              "pairs: it needs positions=ROPE and rotary_interleaved=True")
        if self.rope_optional and self.positions != ROPE:
            raise PolicyError(f"{where}: rope_optional reads a None position_embeddings as a "
                              f"NoPE layer: it needs positions=ROPE, got {self.positions!r}")
        if self.rope_fp32_math and self.positions != ROPE:
            raise PolicyError(f"{where}: rope_fp32_math rotates the model's cos / sin: it needs "
                              f"positions=ROPE, got {self.positions!r}")
        if self.parallel_residual_first and PARALLEL_SHARED_LN not in _choices(self.layout):
            raise PolicyError(f"{where}: parallel_residual_first orders the sum of "
                              f"layout=PARALLEL_SHARED_LN, got {self.layout!r}")
        for entry in self.unsupported_when:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[2], str)):
                raise PolicyError(f"{where}: unsupported_when holds (config attribute, value, "
                                  f"reason) triples, got {entry!r}")
        if self.activation_module is not None and (self.gated or not isinstance(
                self.activation_module, str) or not self.activation_module):
            raise PolicyError(f"{where}: activation_module names the activation module of a "
                              f"plain MLP (gated=False), got {self.activation_module!r} with "
                              f"gated={self.gated}")
        if self.norm_eps is not None and (isinstance(self.norm_eps, bool) or not isinstance(
                self.norm_eps, (int, float)) or self.norm_eps <= 0):
            raise PolicyError(f"{where}: norm_eps must be a positive number or None, got "
                              f"{self.norm_eps!r}")
        if self.rope_sliding_only and not (self.sliding_attr and self.positions == ROPE):
            raise PolicyError(f"{where}: rope_sliding_only tells sliding layers by "
                              "sliding_attr: it needs sliding_attr and positions=ROPE")
        if self.rope_pairs_table and self.rope_half_table:
            raise PolicyError(f"{where}: rope_pairs_table and rope_half_table are two readings "
                              "of the cos / sin tables; a policy takes one")
        for path, style in (self.tp_plan or {}).items():
            _check_choice(f"{where} tp_plan[{path!r}]", "style", style, TP_STYLES)
        if self.moe_shared_mlp is not None and (self.moe is None or not isinstance(
                self.moe_shared_mlp, str) or not self.moe_shared_mlp):
            raise PolicyError(f"{where}: moe_shared_mlp names a block attribute added to a MoE's "
                              f"output: it needs moe, got {self.moe_shared_mlp!r} with "
                              f"moe={self.moe!r}")
        if self.moe is not None and not isinstance(self.moe, MoeLayout):
            raise PolicyError(f"{where}: moe must be a MoeLayout, got {type(self.moe).__name__}")

    def matches(self, model: Any) -> bool:
        return getattr(model.config, "model_type", None) in self.model_types

    def lacking(self, config: Any) -> str | None:
        """What the fused block lacks for this config (unsupported_when), or None."""
        return next((f"{why} ({attr}={value!r})" for attr, value, why in self.unsupported_when
                     if getattr(config, attr, None) == value), None)
