"""FusedBlock: one HF decoder block computed with `hf_dsinfer.kernels` ops.

The HF block instance stays in the model (same class, same parameters, same names, so
state_dict, hooks, output recorders and accelerate keep working); only its `forward` is
replaced on the instance by a FusedBlock. The fused computation follows DeepSpeed-Inference's
deep fusion: the output-projection bias, the residual add and the next LayerNorm/RMSNorm are
one op; bias + activation (or the gated activation) are one op; rotary is applied to Q and K in
one op; attention reads and writes the HF `Cache` it is given (no hidden KV workspace), so
padding, beams, static caches and streamers behave exactly as in HF.

Weights are read from the block's own submodules at call time, never copied.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_dsinfer.errors import NativeUnsupported, TensorParallelError
from hf_dsinfer.hf import cache_args
from hf_dsinfer.hf.outputs import recording
from hf_dsinfer.injection import paged
from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.native_layer import RowSlice, build_decode_layer
from hf_dsinfer.injection.paths import PathRecord
from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import decode as native_decode
from hf_dsinfer.kernels.abi import MLPS_PLAIN, SLOTS
from hf_dsinfer.kernels.abi import NORMS as NATIVE_NORMS
from hf_dsinfer.kernels.activations import bias_act, gated_act, resolve_activation
from hf_dsinfer.kernels.attention import attention as attention_op
from hf_dsinfer.kernels.attention import attention_segments
from hf_dsinfer.kernels.linear import CPU_AMX_MAX_ROWS, linear
from hf_dsinfer.kernels.norms import layer_norm, layer_norm_fp32, layer_norm_plain, rms_norm
from hf_dsinfer.kernels.rotary import apply_rotary

# Sequences up to which a one-token step takes the native batched layer (its projections are
# hfd_linear_bf16 calls, which take up to this many rows).
DECODE_MAX_ROWS = CPU_AMX_MAX_ROWS


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A policy resolved against one block instance and its model config."""

    layout: str
    norm: str
    activation: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    scale_query: bool
    residual_post_ln: bool
    layer_idx: int
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv
    rope: bool = True  # False: a NoPE layer of a RoPE model (SmolLM3)
    attn_softcap: float | None = None  # Gemma 2: tanh soft-cap of the attention logits
    residual_multiplier: float | None = None  # Granite: branch outputs scaled before the add
    sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    mla: bool = False  # DeepSeek-V3: multi-head latent attention (injection.mla)
    window: int | None = None  # a sliding layer's window (HF's mask says the same); None: full
    qk_norm: str | None = None  # the policy's q / k norm for this config (GLM-4.5: use_qk_norm)
    pre_norms: tuple[str | None, str | None] = (None, None)  # policy.ln1 / ln2 for this config

    def describe(self) -> str:
        extras = [name for name, on in (
            ("NoPE", not self.rope), (f"attn softcap {self.attn_softcap}", self.attn_softcap),
            (f"residual x{self.residual_multiplier}", self.residual_multiplier is not None),
            ("attention sinks", self.sinks), ("multi-head latent attention", self.mla),
            (f"sliding window {self.window}", self.window is not None))
            if on]
        return (f"{self.layout}, {self.norm}_norm, {self.num_heads}q/{self.num_kv_heads}kv heads"
                f" x {self.head_dim}, {self.activation}" + "".join(f", {e}" for e in extras))


def _sub(module: nn.Module, name: str | None) -> nn.Module | None:
    if name is None:
        return None
    return module if name == "" else module.get_submodule(name)


def _norm_eps(norm: nn.Module, default: float | None = None) -> float:
    """A norm module's epsilon, or the policy's `norm_eps` for modules that keep none."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(norm, attr):
            return float(getattr(norm, attr))
    if default is not None:
        return default
    raise AttributeError(f"cannot find the epsilon of {type(norm).__name__}; a policy names "
                         "it with norm_eps when the module keeps none")


def _out_features(linear_module: nn.Module, conv1d: bool) -> int:
    w = linear_module.weight
    return w.shape[1] if conv1d else w.shape[0]


MODULE_ACTIVATION = "module"  # BlockSpec.activation of a policy's activation_module


def resolve_spec(block: nn.Module, policy: P.Policy, config: Any, index: int) -> BlockSpec:
    attn = block.get_submodule(policy.attn)
    head_dim = int(getattr(attn, "head_dim", None) or getattr(attn, "qk_head_dim", None)
                   or attn.head_size)  # MLA: q / k head dims (nope + rope)
    projections = [attn.get_submodule(n) for n in policy.qkv]
    if policy.mla is not None:  # its own shapes: injection.mla.MlaSpec
        q_out = kv_out = int(getattr(attn, policy.mla.num_heads_attr)) * head_dim
    elif policy.qkv_layout == P.SEPARATE:
        q_out = _out_features(projections[0], policy.conv1d)
        kv_out = _out_features(projections[1], policy.conv1d)
    elif policy.qkv_layout in (P.PACKED_GQA, P.GROUPED_GQA):  # the config's head counts
        q_out = config.num_attention_heads * head_dim
        kv_out = (_out_features(projections[0], policy.conv1d) - q_out) // 2
    else:  # packed [q | k | v]: three equal parts
        q_out = kv_out = _out_features(projections[0], policy.conv1d) // 3
    scale = float(getattr(attn, policy.scale_attr))
    window = getattr(attn, "sliding_window", None)
    sliding = window is not None and (policy.sliding_attr is None
                                      or bool(getattr(attn, policy.sliding_attr)))
    rope = policy.rope_attr is None or bool(getattr(attn, policy.rope_attr))
    if policy.rope_sliding_only and window is not None and not sliding:
        rope = False  # EXAONE 4's global NoPE layers
    return BlockSpec(
        layout=P.resolve(policy.layout, config),
        norm=policy.norm,
        activation=(MODULE_ACTIVATION if policy.activation_module is not None
                    else resolve_activation(P.resolve(policy.activation, config))),
        num_heads=q_out // head_dim,
        num_kv_heads=kv_out // head_dim,
        head_dim=head_dim,
        scale=1.0 / scale if policy.scale_inverted else scale,
        scale_query=policy.scale_query,
        residual_post_ln=bool(P.resolve(policy.residual_post_ln, config)),
        layer_idx=index if getattr(attn, "layer_idx", None) is None else int(attn.layer_idx),
        clip_qkv=P.resolve(policy.clip_qkv, config),
        rope=rope,
        attn_softcap=None if policy.softcap_attr is None else getattr(attn, policy.softcap_attr),
        residual_multiplier=P.resolve_in_block(policy.residual_multiplier, config, block),
        sinks=_check_sinks(attn, policy, q_out // head_dim),
        mla=policy.mla is not None,
        window=window if sliding else None,
        qk_norm=P.resolve(policy.qk_norm, config),
        pre_norms=(P.resolve(policy.ln1, config), P.resolve(policy.ln2, config)),
    )


def _mla_attention(fused: FusedBlock) -> Any:
    from hf_dsinfer.injection.mla import MlaAttention, resolve_mla_spec

    layout = fused.policy.mla
    # the attention module's own config (HF's MLA modules keep it): rope_interleave
    return MlaAttention(fused, layout, resolve_mla_spec(fused._attn, layout,
                                                        fused._attn.config))


def _check_sinks(attn: nn.Module, policy: P.Policy, num_heads: int) -> bool:
    """The attention has one sink logit per (local) query head; raises where the heads were
    sliced (tensor parallelism) but the sinks were not."""
    if policy.sinks_attr is None:
        return False
    sinks = getattr(attn, policy.sinks_attr)
    if sinks.shape != (num_heads,):
        raise TensorParallelError(
            f"{type(attn).__name__}.{policy.sinks_attr}: expected one attention-sink logit per "
            f"query head ({num_heads}), got shape {tuple(sinks.shape)} (heads sliced by tensor "
            "parallelism, whose plan does not slice the sinks). Fix: use tp_size=1 (ep_size "
            "shards the experts).")
    return True


class FusedBlock:
    """Callable installed as `block.forward`; falls back to the HF forward when asked for what
    fused blocks do not compute (attention weights, by keyword or through the config; training;
    cross-attention)."""

    def __init__(self, block: nn.Module, policy: P.Policy, spec: BlockSpec, backend: str):
        self.block = block
        self.policy = policy
        self.spec = spec
        self.backend = backend
        self.enabled = True  # False: run the HF forward (parity fallback)
        self.calls = 0       # fused calls, so tests can prove the fused path ran
        self.paths = PathRecord()  # which path each call took (injection.paths), for explain
        self._path = "torch"  # the path of the call in progress
        self.paged = paged.PagedStats()  # continuous-batching calls (injection.paged)
        # Tensor parallelism (hf_dsinfer.parallel): sums the row-parallel partial outputs over
        # the TP group before their bias is added; head_slice picks this rank's ALiBi heads.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_slice: slice | None = None
        # OLMoE's q/k norm over the whole projection when the heads are sharded: (q, k) ->
        # (q, k) normalized with the sum of squares all-reduced over the TP group.
        self.sharded_qk_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.hf_forward = type(block).forward.__get__(block)
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]
        self._arg_names = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        self.bind()
        self._layouts = {
            P.SEQUENTIAL: self._sequential,
            P.PARALLEL: self._parallel,
            P.PARALLEL_SHARED_LN: self._parallel_shared_ln,
            P.POST_LN: self._post_ln,
            P.SANDWICH: self._sandwich,
        }

    def bind(self) -> None:
        """(Re)resolve the submodules the fused computation reads, by their HF names."""
        policy, block = self.policy, self.block
        self._attn = block.get_submodule(policy.attn)
        self._qkv = [self._attn.get_submodule(n) for n in policy.qkv]
        self._out = self._attn.get_submodule(policy.out_proj)
        ln1, ln2 = self.spec.pre_norms
        self._ln1 = _sub(block, ln1)
        # a parallel block off one norm reads no second one (StableLM's parallel configs
        # drop the module its sequential ones have)
        self._ln2 = None if self.spec.layout == P.PARALLEL_SHARED_LN else _sub(block, ln2)
        self._post_attn = _sub(block, policy.post_attn_norm)  # SANDWICH's post-norms
        self._post_mlp = _sub(block, policy.post_mlp_norm)
        self._mlp_module = _sub(block, policy.mlp)
        # A sparse-MoE MLP is computed by its own module, whose forward the walker replaced by a
        # FusedMoE (hf_dsinfer.injection.moe); dense layers of MoE models use mlp_in / mlp_out.
        moe = policy.moe
        self.is_moe = moe is not None and type(self._mlp_module).__name__ in moe.classes
        mlp_in = () if self.is_moe else policy.mlp_in
        self._mlp_in = [self._mlp_module.get_submodule(n) for n in mlp_in]
        self._mlp_out = None if self.is_moe else self._mlp_module.get_submodule(policy.mlp_out)
        # Granite MoE shared's MLP beside the experts (None: the layer has none)
        self._moe_shared = (getattr(block, policy.moe_shared_mlp, None)
                            if self.is_moe and policy.moe_shared_mlp else None)
        self._act_module = (None if self.is_moe or policy.activation_module is None
                            else self._mlp_module.get_submodule(policy.activation_module))
        if self.spec.qk_norm is not None:
            self._q_norm, self._k_norm = (self._attn.get_submodule(n) for n in policy.qk_norm_attrs)
        self.mla = None if policy.mla is None else _mla_attention(self)
        # the native one-token decode layer (kernels.decode), built on the first decode call
        self._decode: native_decode.DecodeLayer | None = None
        self._decode_key: tuple | None = None  # weights the last failed build looked at
        self._decode_build_why: str | None = None
        # the width of the cos / sin the native layer rotates with: the config's partial rotary
        # (Phi-3's partial_rotary_factor) until a call shows the model's own
        self._rotary_dim = _config_rotary_dim(self._attn, self.spec.head_dim)
        # the MLP kind as kernels.decode names it (None: one it does not compute)
        act, gated = self.spec.activation, self.policy.gated
        self._decode_mlp = ("gated_silu" if gated and act == "silu"
                            else "gated_gelu_tanh" if gated and act == "gelu_tanh"
                            else act if not gated and act in MLPS_PLAIN else None)
        self._decode_layout_why: str | None = self._decode_policy_why()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (deepcopy / torch.save of the model) leave the native layer out:
        it points at this block's weights, and the copy builds its own on first use."""
        state = self.__dict__.copy()
        state.update(_decode=None, _decode_key=None, _decode_build_why=None)
        return state

    @property
    def decode_why(self) -> str | None:
        """Why one-token steps of this block do not run the native decode layer (None: they
        do, where the call allows: bf16, CPU, no grad; batches also need `rows_why` None)."""
        return self._decode_layout_why or self._decode_build_why or (
            None if _native.lib() is not None else f"native kernels unavailable "
                                                    f"({_native.why_unavailable()})")

    def _decode_policy_why(self) -> str | None:
        """Why this block's layout is not one kernels.decode computes (None: it is): pre-norm
        blocks with separate q/k/v and either Llama's RMSNorm, rotate-half RoPE and SiLU-gated
        MLP or OPT's LayerNorm, learned positions (added before the blocks), scaled query and
        fc1 -> ReLU -> fc2; biases anywhere; RoPE over interleaved pairs read from Llama's
        tables (ERNIE 4.5, Helium, GLM); per-head q/k RMSNorm (Qwen3, Gemma 3), after RoPE
        (HunYuan) or over the whole projection (OLMo 2), NoPE layers (SmolLM3), a residual
        multiplier (Granite),
        fused [q | k | v] and [gate | up] projections (Phi-3); sandwich norms (Gemma 2/3,
        OLMo 2), the fp32 and (1 + w) RMSNorms, GeGLU, an attention soft-cap (Gemma 2)."""
        p, spec, mlp = self.policy, self.spec, self._decode_mlp
        checks = [
            ((spec.layout == P.SEQUENTIAL and not spec.residual_post_ln)
             or spec.layout == P.SANDWICH, "not a pre-norm block"),  # sandwich: pre-norms optional
            (p.norm in NATIVE_NORMS, f"{p.norm} norm"),
            ((p.positions == P.ROPE and (not p.rotary_interleaved or p.rope_pairs_table))
             or p.positions == P.NO_POSITIONS,
             ("positions are neither rotate-half RoPE, interleaved pairs from Llama's tables "
              "nor added before the blocks")),
            (self._qkv_rows and not self.is_moe and mlp is not None,
             ("not separate q/k/v with an MLP the C layer computes (SiLU- or GELU-gated; "
              "ReLU, squared ReLU or tanh GELU)")),
            (spec.clip_qkv is None, "q/k/v clipping"),
            (spec.qk_norm != P.QK_NORM_MODULE, "q / k LayerNorms"),
            (not p.rope_half_table, "a half-width cos / sin table"),
            (p.mla is None, "multi-head latent attention"),
            (not spec.sinks, "attention sinks"),
            (not p.conv1d, "Conv1D projections"),
            (self.backend == "cpu", f"kernels backend {self.backend!r}"),
        ]
        return next((why for ok, why in checks if not ok), None)

    def linear_slots(self) -> list[tuple[nn.Module, str, nn.Module]]:
        """(parent, attribute name, module) of every linear layer the block computes with."""
        policy, attn, mlp = self.policy, self._attn, self._mlp_module
        names = [(attn, n) for n in (*policy.qkv, policy.out_proj)]
        if self.mla is not None:
            names = [(attn, n) for n in self.mla.linear_names()]
        if not self.is_moe:  # MoE experts are quantized by hf_dsinfer.injection.moe
            names += [(mlp, n) for n in (*policy.mlp_in, policy.mlp_out)]
        elif self._moe_shared is not None:  # the linears of the MLP beside the experts
            names += [(self._moe_shared, n) for n, m in self._moe_shared.named_children()
                      if isinstance(m, nn.Linear)]
        return [(parent, n, parent.get_submodule(n)) for parent, n in names]

    def linear_in_features(self) -> list[int]:
        return [m.weight.shape[0 if self.policy.conv1d else 1] for _, _, m in self.linear_slots()
                if hasattr(m, "weight")]

    # -- entry point ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = dict(zip(self._arg_names, args))
        named.update(kwargs)
        counting = not torch.compiler.is_compiling()  # a mutated Python int forces recompiles
        why = paged.defer_why(self, named) or self._hf_why(named)
        if why is not None:
            if self.reduce is not None:
                _refuse_hf_forward_under_tp(named)
            if counting:
                self.paths.took("hf", why)
            return self.hf_forward(*args, **kwargs)
        if counting:  # the path the call takes; _decode_step refines it
            self._path = "paged" if paged.cache_of(self, named) is not None else "torch"
        out = self._layouts[self.spec.layout](named["hidden_states"], named)
        if counting:
            self.calls += 1
            self.paths.took(self._path)
        return (out, None) if self.policy.returns_tuple else out

    def _hf_why(self, named: dict[str, Any]) -> str | None:
        """Why this call runs HF's forward (None: it runs fused)."""
        if not self.enabled:
            return "kept by the parity gate"
        if self.block.training:
            return "training mode"
        if named.get("output_attentions") or recording("attentions"):  # keyword or config
            return "attention weights asked for"
        if named.get("encoder_hidden_states") is not None:
            return "cross-attention"
        return None

    # -- residual wirings (policy.layout) ------------------------------------------------------
    def _sequential(self, x: torch.Tensor, named: dict, attn=None) -> torch.Tensor:
        if attn is None and self._decode_layout_why is None:
            out = self._decode_step(x, named)
            if out is not None:
                return out
        h1 = self._norm(self._ln1, x) if attn is None else None
        attn_out, attn_bias = self._branch(*(self._attention(h1, named) if attn is None
                                             else attn))
        residual = h1 if self.spec.residual_post_ln else x
        h2, hidden = self._norm_add(self._ln2, attn_out, residual, attn_bias)
        mlp_out, mlp_bias = self._branch(*self._mlp(h2))
        residual = h2 if self.spec.residual_post_ln else hidden
        return residual + _add_bias(mlp_out, mlp_bias)

    def _sandwich(self, x: torch.Tensor, named: dict, attn=None) -> torch.Tensor:
        """Norms after attention and after the MLP, before each residual add (OLMo 2, Gemma
        2/3), and optional pre-norms (Gemma's input / pre-feedforward norms; OLMo 2 has none).
        A residual multiplier scales each post-norm's output (HyperCLOVA X's Peri-LN:
        `x + post_norm(branch) * m`). attn: the attention's (output, bias) when the native
        layer computed it already."""
        if attn is None and self._decode_layout_why is None:
            out = self._decode_step(x, named)
            if out is not None:
                return out
        if attn is None:
            h = x if self._ln1 is None else self._norm(self._ln1, x)
            attn = self._attention(h, named)
        h = x + self._post_branch(self._post_attn, *attn)
        mlp_in = h if self._ln2 is None else self._norm(self._ln2, h)
        return h + self._post_branch(self._post_mlp, *self._mlp(mlp_in))

    def _post_branch(self, norm: nn.Module, out: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """A sandwich block's branch as it reaches the residual add: its post-norm of
        (output + bias), times the residual multiplier where the block has one."""
        y = self._norm_add(norm, out, None, bias)[0]
        m = self.spec.residual_multiplier
        return y if m is None else y * m

    def _branch(self, out: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An attention / MLP output (bias apart) as it reaches the residual add: Granite's
        `residual + branch * residual_multiplier`, the bias inside the product."""
        m = self.spec.residual_multiplier
        return (out, bias) if m is None else (_add_bias(out, bias) * m, None)

    def _parallel(self, x: torch.Tensor, named: dict) -> torch.Tensor:
        attn_out, attn_bias = self._attention(self._norm(self._ln1, x), named)
        mlp_out, mlp_bias = self._mlp(self._norm(self._ln2, x))
        if self.reduce is not None:  # one all-reduce carries both partial sums
            return _add_bias(_add_bias(self.reduce(mlp_out + attn_out), mlp_bias), attn_bias) + x
        return _add_bias(mlp_out, mlp_bias) + _add_bias(attn_out, attn_bias) + x

    def _parallel_shared_ln(self, x: torch.Tensor, named: dict) -> torch.Tensor:
        h = self._norm(self._ln1, x)
        attn_out, attn_bias = self._attention(h, named)
        mlp_out, mlp_bias = self._mlp(h)
        if self.reduce is not None:  # one all-reduce carries both partial sums
            return _add_bias(_add_bias(self.reduce(attn_out + mlp_out), attn_bias), mlp_bias) + x
        if self.policy.parallel_residual_first:  # Cohere: (x + attn) + mlp
            return x + _add_bias(attn_out, attn_bias) + _add_bias(mlp_out, mlp_bias)
        return _add_bias(attn_out, attn_bias) + _add_bias(mlp_out, mlp_bias) + x

    def _post_ln(self, x: torch.Tensor, named: dict) -> torch.Tensor:
        attn_out, attn_bias = self._attention(x, named)
        h, _ = self._norm_add(self._ln1, attn_out, x, attn_bias)
        mlp_out, mlp_bias = self._mlp(h)
        out, _ = self._norm_add(self._ln2, mlp_out, h, mlp_bias)
        return out

    # -- native one-token decode (kernels.decode) ------------------------------------------------
    def _after_attention(self, x: torch.Tensor, named: dict, attn) -> torch.Tensor:
        """The layer from the attention's (output, bias) on, in the block's layout."""
        if self.spec.layout == P.SANDWICH:
            return self._sandwich(x, named, attn=attn)
        return self._sequential(x, named, attn=attn)

    def decode_layer(self, rope_fp32: bool = False,
                     rotary_dim: int | None = None) -> native_decode.DecodeLayer | None:
        """The native layer for this block's current weights (built, or rebuilt after the
        weights moved), or None with the reason in `decode_why`. rope_fp32: the model's cos /
        sin are fp32 (OLMo 2 rotates in fp32); rotary_dim: their width (partial rotary where
        less than head_dim: Phi-3's partial_rotary_factor; None: the last call's, at first the
        config's)."""
        if self._decode_layout_why is not None:
            return None
        rope = ("none" if not (self.policy.positions == P.ROPE and self.spec.rope)
                else ("fp32" if rope_fp32 else "bf16")
                + ("_pairs" if self.policy.rope_pairs_table else ""))
        rotary_dim = self._rotary_dim if rotary_dim is None else rotary_dim
        rotary_dim = None if rotary_dim == self.spec.head_dim else rotary_dim
        layer = self._decode
        if (layer is not None and layer.current()
                and (not layer.rope or (layer.rope_dtype == (torch.float32 if rope_fp32
                                                             else torch.bfloat16)
                                        and layer.rotary_dim == (rotary_dim
                                                                 or self.spec.head_dim)))):
            return layer
        norm = next(n for n in (self._ln1, self._post_attn, self._ln2) if n is not None)
        key = (norm.weight.dtype, norm.weight.data_ptr(), rope, rotary_dim,
               *(id(m) for m in (*self._qkv, self._out, *self._mlp_in, self._mlp_out)))
        qk_norm = None if self.spec.qk_norm is None else (
            self._q_norm, self._k_norm, _norm_eps(self._q_norm), _norm_eps(self._k_norm))
        if self._decode_key == key:
            return None  # this set of weights failed already
        self._decode, self._decode_key, self._decode_build_why = None, None, None
        spec = self.spec
        try:
            self._decode = build_decode_layer(
                self._ln1, self._ln2, tuple(0.0 if n is None else _norm_eps(n)
                                            for n in (self._ln1, self._ln2)),
                self._decode_linears(), spec.num_heads,
                spec.num_kv_heads, spec.head_dim, 1.0 if spec.scale_query else spec.scale,
                norm=self.policy.norm, rope=rope,
                mlp=self._decode_mlp, q_scale=spec.scale if spec.scale_query else None,
                qk_norm=qk_norm, residual_multiplier=spec.residual_multiplier,
                qk_norm_full=self.spec.qk_norm == P.QK_NORM_FULL,
                post_norms=self._decode_post_norms(), softcap=spec.attn_softcap,
                window=spec.window, rotary_dim=rotary_dim,
                qk_norm_after_rope=self.policy.qk_norm_after_rope)
        except NativeUnsupported as err:
            self._decode_key, self._decode_build_why = key, str(err)
        return self._decode

    def _decode_post_norms(self) -> tuple | None:
        """(post-attention norm, post-MLP norm, their eps) of a sandwich block, else None."""
        if self.spec.layout != P.SANDWICH:
            return None
        pa, pm = self._post_attn, self._post_mlp
        return pa, pm, _norm_eps(pa), _norm_eps(pm)

    @property
    def _qkv_rows(self) -> bool:
        """q, k and v are row ranges of their projections, as the C layer reads them: separate
        projections, or one [q | k | v] (Phi-3's packing; Falcon's and GPTBigCode's per-KV-head
        packing with one KV head is the same rows)."""
        layout = self.policy.qkv_layout
        return layout in (P.SEPARATE, P.PACKED_GQA) or (
            layout == P.GROUPED_GQA and self.spec.num_kv_heads == 1)

    def _decode_linears(self) -> dict:
        """q, k, v, o, gate, up, down (OPT: fc1, None, fc2) as kernels.decode takes them: the
        parts of a fused qkv_proj / gate_up_proj (Phi-3) as row slices of it."""
        spec, d = self.spec, self.spec.head_dim
        qkv = list(self._qkv)
        if self.policy.qkv_layout != P.SEPARATE:  # [q | k | v] (_qkv_rows)
            q, kv = spec.num_heads * d, spec.num_kv_heads * d
            qkv = [RowSlice(qkv[0], at, n)
                   for at, n in ((0, q), (q, kv), (q + kv, kv))]
        mlp_in = (list(self._mlp_in) if self._decode_mlp not in MLPS_PLAIN
                  else [self._mlp_in[0], None])
        if len(mlp_in) == 1:  # [gate | up]
            inter = mlp_in[0].out_features // 2
            mlp_in = [RowSlice(mlp_in[0], at, inter) for at in (0, inter)]
        return dict(zip(SLOTS, (*qkv, self._out, *mlp_in, self._mlp_out), strict=True))

    def decode_ready(self, rope_fp32: bool = False,
                     rotary_dim: int | None = None) -> native_decode.DecodeLayer | None:
        """The native layer, when this block computes with it at all (fused, in eval, not
        sharded). The caller checks the call itself (one bf16 token per sequence, no grad)
        and that the library is loaded: a build without it would be remembered as failed.
        rope_fp32, rotary_dim: the model's cos / sin, as `decode_layer` takes them."""
        if (not self.enabled or self.block.training or self.reduce is not None
                or self.sharded_qk_norm is not None):
            return None
        return self.decode_layer(rope_fp32, rotary_dim)

    def _decode_step(self, x: torch.Tensor, named: dict) -> torch.Tensor | None:
        """This block's own call for one token of each sequence, when the native layer takes it
        (None: this call takes the torch path). One sequence runs the batch-1 layer (any weight
        kind); up to the layer's rows_max sequences the batched one (DecodeLayer.rows_why says
        which weights). The checks are per call here; NativeDecodeStep makes them once per
        step for every layer and then calls `native_token` as this does."""
        if (paged_cache := paged.cache_of(self, named)) is not None:
            return self._paged_native(x, named, paged_cache)
        b = x.shape[0]
        if x.shape[1] != 1 or not self._native_call(x, b):
            return None
        cache = cache_args.dense_cache(named, self.policy.cache_arg)
        if cache is None:
            return None
        layer, cos, sin = self._native_layer_for(named, b)
        if layer is None:
            return None
        out, self._path = self.native_token(layer, x.contiguous(), cos, sin, cache, named)
        return out

    def _native_call(self, x: torch.Tensor, rows: int) -> bool:
        """A call the native layer may take: `rows` tokens of bf16 on the CPU, no grad, no
        trace, not tensor parallel."""
        return (rows <= DECODE_MAX_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and self.reduce is None and self.sharded_qk_norm is None
                and _native.lib() is not None)

    def _native_layer_for(self, named: dict, rows: int):
        """(layer, cos, sin) for one token of each of `rows` rows: the native layer when it
        takes them (None otherwise) and the call's cos / sin as [rows or 1, r] rows (None
        without RoPE)."""
        cos = sin = None
        if self.policy.positions == P.ROPE:
            d = self.spec.head_dim
            cos_sin = named.get("position_embeddings")
            r = None if cos_sin is None else cos_sin[0].shape[-1]  # < d: partial rotary
            if (cos_sin is None or not 0 < r <= d
                    or cos_sin[0].numel() not in (r, rows * r)
                    or cos_sin[1].shape != cos_sin[0].shape
                    or cos_sin[0].dtype not in (torch.bfloat16, torch.float32)
                    or cos_sin[1].dtype != cos_sin[0].dtype):
                return None, None, None
            cos, sin = (t.reshape(-1, r).contiguous() for t in cos_sin)
            self._rotary_dim = r
        layer = self.decode_layer(rope_fp32=cos is not None and cos.dtype == torch.float32,
                                  rotary_dim=None if cos is None else cos.shape[-1])
        if layer is None or (rows > 1 and (layer.rows_why is not None or rows > layer.rows_max)):
            return None, None, None
        return layer, cos, sin

    def _paged_native(self, x: torch.Tensor, named: dict, cache: Any) -> torch.Tensor | None:
        """A continuous-batching forward by the native layer, when it takes the packed row's
        T tokens (bf16, T within the batched layer's rows_max; None, the torch path, otherwise,
        before the cache is touched):
        - one request's decode step (paged.decode_only, one token): the batch-1 layer;
        - otherwise attn_in_rows over every packed token (each row rotated at its own
          position), the paged cache's own update, each request's queries attended over its
          own keys (attention_segments: the decode rows in one native call, each prefill chunk
          by torch's attention, causal without a mask where its block is), post_attn_rows over
          every token. Path "paged_native" for decode-only forwards, "paged_native_mixed" with
          prefill chunks. Per token the same kernels and roundings as the torch path, which
          computes the chunks' linears on these rows' AMX kernels too.
        Where the mask is not one the kernels read, the torch path from the attention on (the
        cache is updated)."""
        t = x.shape[1]
        if x.shape[0] != 1 or not self._native_call(x, t):
            return None
        decode = paged.decode_only(named, t)
        if not decode and t == 1:
            return None
        layer, cos, sin = self._native_layer_for(named, t)
        if layer is None:
            return None
        rows = x.reshape(t, 1, -1).contiguous()
        if t == 1:
            q, k, v = layer.step_in(rows, cos, sin)  # q [1, heads, 1, d], k / v [1, kv, 1, d]
        else:  # [t, heads, 1, d] views of [t, 1, heads, d]: as [1, heads, t, d]
            q, k, v = (u.permute(2, 1, 0, 3) for u in layer.attn_in_rows(rows, cos, sin))
        keys, values, segments = paged.update(self, cache, k, v, named)
        mask = named["attention_mask"]
        out = None
        if t == 1:  # the batch-1 layer reads keys left in the cache through the read index
            usable, keep = native_decode.keep_rows(mask, 1, keys.shape[2])
            if usable and native_decode.cache_kv_usable(keys, values, self.spec.head_dim):
                out = layer.attn_out(rows, q, keys, values, None if keep is None
                                     else keep.reshape(-1))
        elif segments is not None:  # decode rows in one native call, chunks by torch's
            heads, d = self.spec.num_heads, self.spec.head_dim
            a = torch.empty(t, heads, d, dtype=torch.bfloat16)
            self._attend_segments(q, keys, values, named, segments, q_scaled=True,
                                  out=a.permute(1, 0, 2).unsqueeze(0))
            out = layer.post_attn_rows(rows, a.view(t, heads * d))
        if out is None:  # the torch path from the attention on (the cache is updated)
            attn = self._attend(q, keys, values, named, 1, t, q_scaled=True, segments=segments)
            return self._after_attention(x, named, attn)
        self._path = "paged_native" if decode else "paged_native_mixed"
        return out.view(1, t, -1)

    def native_token(self, layer: native_decode.DecodeLayer, x: torch.Tensor,
                     cos: torch.Tensor | None, sin: torch.Tensor | None, cache: Any,
                     named: dict | None, keep: torch.Tensor | None = None,
                     keys: int | None = None) -> tuple[torch.Tensor, str]:
        """The one native one-token step of this block, for both callers (`_decode_step` and
        NativeDecodeStep's loop): the attention's input half in C, then the cache's own
        attention (`dsinfer_attend`) or its update, then the output half in C over the cached
        keys; where the cache or the mask is not what the kernel reads, the torch path from the
        attention on. Returns the output and the path: "native" / "native_rows" (both halves in
        C) or "native_in" (the first only).

        named: the block's call (its 4-D HF mask gives the keys to attend); or None with
        `keep` (uint8 [rows or 1, keys] or None: every key) and `keys`, the number of keys after
        this token (a static cache returns more, unused)."""
        b, d = x.shape[0], self.spec.head_dim
        q, k, v = layer.step_in(x, cos, sin)
        if getattr(cache, "dsinfer_attend", None) is not None:
            named = named or _keep_call(keep)
            if (attn := self._attend_in_cache(cache, q, k, v, named, b, q_scaled=True)) is not None:
                return self._after_attention(x, named, attn), "native_in"
        k, v = append_kv(cache, k, v, self.spec.layer_idx)
        if named is None:
            usable = True
            if k.shape[2] != keys:  # a static cache: its keys past this token are unused
                k, v = k[:, :, :keys], v[:, :, :keys]
        else:
            usable, keep = native_decode.keep_rows(named.get("attention_mask"), b, k.shape[2])
        if usable and native_decode.cache_kv_usable(k, v, d, b):
            return layer.step_out(x, q, k, v, keep), "native" if b == 1 else "native_rows"
        # a cache or mask the kernel does not read: the torch path from the attention on
        named = named or _keep_call(keep)
        return (self._after_attention(x, named, self._attend(q, k, v, named, b, 1, q_scaled=True)),
                "native_in")

    # -- pieces --------------------------------------------------------------------------------
    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._norm_add(norm, x, None, None)[0]

    def _norm_add(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                  x_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + (x + x_bias)), residual + (x + x_bias)) in one kernel."""
        eps = _norm_eps(norm, self.policy.norm_eps)
        if self.spec.norm in P.RMS_STYLES:
            return rms_norm(x, norm.weight, eps, residual, x_bias, backend=self.backend,
                            style=P.RMS_STYLES[self.spec.norm])
        if self.spec.norm == P.LAYER_FP32:
            return layer_norm_fp32(x, norm.weight, eps, residual, x_bias)
        if self.spec.norm == P.LAYER_PLAIN:
            return layer_norm_plain(x, eps, residual, x_bias)
        if self.spec.norm == P.LAYER_1P:  # the 1 + w sum in the weight's dtype, as HF's
            return layer_norm(x, norm.weight + 1.0, norm.bias, eps, residual, x_bias,
                              backend=self.backend)
        return layer_norm(x, norm.weight, norm.bias, eps, residual, x_bias, backend=self.backend)

    def _linear(self, module: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        if isinstance(module, QuantizedLinear):
            return module.matmul(x, with_bias)
        weight = module.weight.t() if self.policy.conv1d else module.weight  # [out, in]
        return linear(x, weight, module.bias if with_bias else None, backend=self.backend)

    def _project_qkv(self, x: torch.Tensor):
        b, s, _ = x.shape
        d = self.spec.head_dim
        if self.policy.qkv_layout == P.SEPARATE:
            q, k, v = [self._linear(m, x) for m in self._qkv]
        elif self.policy.qkv_layout == P.PACKED:
            q, k, v = self._linear(self._qkv[0], x).chunk(3, dim=-1)
        elif self.policy.qkv_layout == P.PACKED_GQA:
            kv = self.spec.num_kv_heads * d
            q, k, v = self._linear(self._qkv[0], x).split(
                [self.spec.num_heads * d, kv, kv], dim=-1)
        else:  # GROUPED_GQA: per KV head [q x group, k, v]
            group = self.spec.num_heads // self.spec.num_kv_heads
            qkv = self._linear(self._qkv[0], x).view(b, s, self.spec.num_kv_heads, group + 2, d)
            q, k, v = [t.reshape(b, s, -1) for t in qkv.split([group, 1, 1], dim=3)]
        q, k, v = self._qk_norm(q, k, v)
        return [t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v)]  # [B, H, S, D]

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Qwen3-MoE: RMSNorm over each head's dims; OLMoE: over the whole q / k projection,
        then q, k, v clamped to +-clip_qkv. q, k, v are [B, S, heads * D]."""
        if self.sharded_qk_norm is not None:
            q, k = self.sharded_qk_norm(q, k)
        elif self.spec.qk_norm == P.QK_NORM_MODULE:
            q, k = self._module_norm(q, self._q_norm), self._module_norm(k, self._k_norm)
        elif self.spec.qk_norm is not None and not self.policy.qk_norm_after_rope:
            q, k = self._rms_last(q, self._q_norm), self._rms_last(k, self._k_norm)
        if self.spec.clip_qkv is not None:
            c = self.spec.clip_qkv
            q, k, v = [t.clamp(-c, c) for t in (q, k, v)]
        return q, k, v

    def _module_norm(self, t: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """The attention's own q / k norm module on [B, S, heads * D], laid out as HF hands it
        the heads ([B, heads, S, D] where qk_norm_heads_first, else [B, S, heads, D])."""
        heads = t.unflatten(-1, (-1, self.spec.head_dim))  # [B, S, h, D]
        if self.policy.qk_norm_heads_first:
            return norm(heads.transpose(1, 2)).transpose(1, 2).flatten(-2)
        return norm(heads).flatten(-2)

    def _rms_last(self, t: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """RMSNorm of [B, S, heads * D] over D (per head) or over the whole last dim."""
        width = self.spec.head_dim if self.spec.qk_norm == P.QK_NORM_HEAD else t.shape[-1]
        out, _ = rms_norm(t.unflatten(-1, (-1, width)), norm.weight, _norm_eps(norm),
                          backend=self.backend, style=P.RMS_STYLES[self.spec.norm])
        return out.flatten(-2)

    def _attention(self, x: torch.Tensor, named: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.mla is not None:
            return self.mla(x, named)
        b, s, _ = x.shape
        q, k, v = self._project_qkv(x)
        q, k = self._rotate(q, k, named)
        if self.policy.qk_norm_after_rope:  # [B, H, S, D]: each rotated head over its D
            q, k = self._rms_last(q, self._q_norm), self._rms_last(k, self._k_norm)
        cache = cache_args.dense_cache(named, self.policy.cache_arg)
        if cache is not None:
            if s == 1 and (done := self._attend_in_cache(cache, q, k, v, named, b)) is not None:
                return done
            idx = self.spec.layer_idx
            k, v = append_kv(cache, k, v, idx) if s == 1 else cache.update(k, v, idx)
        elif (paged_cache := paged.cache_of(self, named)) is not None:  # continuous batching
            k, v, segments = paged.update(self, paged_cache, k, v, named)
            if segments is not None:
                return self._attend(q, k, v, named, b, s, segments=segments)
        return self._attend(q, k, v, named, b, s)

    @property
    def attends_in_cache(self) -> bool:
        """Decode steps ask a cache that offers it (`dsinfer_attend`) to attend where its
        K/V live: every layout but ALiBi's (whose bias the cache's kernel does not take) and
        soft-capped attention (which it does not compute)."""
        return (self.enabled and self.policy.positions != P.ALIBI
                and self.spec.attn_softcap is None  # nor the soft-cap
                and not self.spec.sinks  # nor the sinks
                and self.mla is None)  # nor MLA, whose cache holds a latent

    def _attend_in_cache(self, cache: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         named: dict, b: int, q_scaled: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """FlexGen's attention where the cache lives: a cache with `dsinfer_attend` (the
        offload engine's 4-bit BlockCache) appends this token's k, v and attends over its stored
        codes itself, with no dense copy of the cache. None: this cache or call does not, and
        nothing was appended."""
        attend = getattr(cache, "dsinfer_attend", None)
        if attend is None or not self.attends_in_cache:
            return None
        scale = self.spec.scale
        if self.spec.scale_query:  # as in _attend
            q, scale = (q if q_scaled else q * scale), 1.0
        out = attend(q, k, v, self.spec.layer_idx, scale, named.get("attention_mask"))
        if out is None:
            return None
        if not torch.compiler.is_compiling():
            self.paths.took("cache_attend")
        return self._project_out(out, b, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, named: dict, b: int,
                s: int, q_scaled: bool = False,
                segments: list[tuple[int, int, int, int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of rotated q over the (cache-updated) k, v, then the output projection.
        q_scaled: q already carries OPT's query scaling (the native decode layer's q).
        segments: the packed requests of a continuous-batching row (paged.segments), each
        attending over its own keys."""
        if segments is not None:  # no ALiBi here (paged.layout_why sends it to HF)
            return self._project_out(self._attend_segments(q, k, v, named, segments, q_scaled),
                                     b, s)
        scale = self.spec.scale
        if self.spec.scale_query:  # OPT scales q before QK^T; keep its rounding in half precision
            q, scale = (q if q_scaled else q * scale), 1.0
        mask = named.get("attention_mask")
        sinks = getattr(self._attn, self.policy.sinks_attr) if self.spec.sinks else None
        bias = self._alibi(named, b)
        if mask is None and s > 1 and k.shape[2] > s:
            # HF passes no mask only when SDPA's *top-left* causal rule is right, e.g. a
            # padding-free prefill into a longer static cache: no query sees keys past s.
            k, v = k[:, :, :s], v[:, :, :s]
            bias = None if bias is None else bias[..., :s]
        out = attention_op(
            q, k, v, scale=scale, mask=mask, causal=mask is None and s > 1, bias=bias,
            backend=self.backend, softcap=self.spec.attn_softcap, sinks=sinks,
        )  # [B, H, S, D]
        return self._project_out(out, b, s)

    def _attend_segments(self, q: torch.Tensor, k: Any, v: Any, named: dict,
                         segments: list[tuple[int, int, int, int]], q_scaled: bool = False,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention [1, H, T, D] of a continuous-batching row's requests, each over its own
        keys (attention_segments; written into `out` when given), before the output
        projection. q_scaled as in _attend."""
        scale = self.spec.scale
        if self.spec.scale_query:  # as in _attend
            q, scale = (q if q_scaled else q * scale), 1.0
        sinks = getattr(self._attn, self.policy.sinks_attr) if self.spec.sinks else None
        return attention_segments(q, k, v, segments, scale=scale,
                                  mask=named["attention_mask"], backend=self.backend,
                                  softcap=self.spec.attn_softcap, sinks=sinks, out=out)

    def _project_out(self, out: torch.Tensor, b: int, s: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output [B, H, S, D] through the output projection (its bias apart)."""
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self._row_parallel(self._linear(self._out, out, with_bias=False)), self._out.bias

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, named: dict):
        positions = self.policy.positions
        if not self.spec.rope:  # a NoPE layer
            return q, k
        if positions == P.ROPE:
            if named["position_embeddings"] is None and self.policy.rope_optional:
                return q, k  # a NoPE layer the model chose by passing no tables
            cos, sin = named["position_embeddings"]
            if self.policy.rope_half_table:  # [.., D/2] -> Llama's [.., D] (same products)
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            elif self.policy.rope_pairs_table:  # [f0 f1 .. f0 f1 ..] -> [f0 f0 f1 f1 ..]
                half = cos.shape[-1] // 2
                cos = cos[..., :half].repeat_interleave(2, dim=-1)
                sin = sin[..., :half].repeat_interleave(2, dim=-1)
            if self.policy.rope_fp32_math:  # bf16 q times fp32 cos: the products in fp32
                cos, sin = cos.float(), sin.float()
        elif positions == P.ROPE_TABLE:
            cos, sin = _gptj_cos_sin(self._attn, named, q.dtype)
        else:
            return q, k
        return apply_rotary(q, k, cos, sin, interleaved=self.policy.rotary_interleaved,
                            backend=self.backend)

    def _alibi(self, named: dict, batch: int) -> torch.Tensor | None:
        if self.policy.positions != P.ALIBI:
            return None
        alibi = named["alibi"]  # [B * H, 1, S_k], built by HF for all heads
        alibi = alibi.view(batch, -1, 1, alibi.shape[-1])
        return alibi if self.head_slice is None else alibi[:, self.head_slice]

    def _mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_moe:  # the MoE module's forward is a FusedMoE
            out = self._mlp_module(x)  # gpt-oss's MoE returns (hidden, router scores)
            out = out[0] if isinstance(out, tuple) else out
            if self._moe_shared is not None:  # HF's moe + shared_mlp(x), its module as is
                out = out + self._moe_shared(x)
            return out, None
        if self.policy.gated:  # one projection: its output is [gate | up]
            gate, up = (*(self._linear(m, x) for m in self._mlp_in), None)[:2]
            h = gated_act(gate, up, self.spec.activation, backend=self.backend)
        elif self._act_module is not None:  # Apertus's xIELU: HF's module, its parameters
            h = self._act_module(self._linear(self._mlp_in[0], x))
        else:
            fc1 = self._mlp_in[0]
            h = bias_act(self._linear(fc1, x, with_bias=False), fc1.bias, self.spec.activation,
                         backend=self.backend, inplace=True)  # fc1's output is ours
        out = self._linear(self._mlp_out, h, with_bias=False)
        return self._row_parallel(out), self._mlp_out.bias

    def _row_parallel(self, partial: torch.Tensor) -> torch.Tensor:
        """All-reduce a row-parallel output under tensor parallelism (parallel residual layouts
        reduce attention + MLP together instead, in the layout)."""
        if self.reduce is None or self.spec.layout in (P.PARALLEL, P.PARALLEL_SHARED_LN):
            return partial
        return self.reduce(partial)


# Spare tokens a growing cache layer keeps: at least this many, or a quarter of its length
# (at most 25% more memory than HF's cache; one copy of the layer per n / 4 steps, not per step).
KV_SPARE_MIN = 64


def _keep_call(keep: torch.Tensor | None) -> dict[str, Any]:
    """A block call's mask from NativeDecodeStep's keep rows (uint8 [rows or 1, keys] or None)."""
    return {"attention_mask": None if keep is None
            else keep.bool().reshape(-1, 1, 1, keep.shape[-1])}


def append_kv(cache: Any, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
    """`cache.update(k, v, layer_idx)` for one new token, without rewriting the whole cache.

    HF's DynamicLayer appends with `torch.cat([keys, k], -2)`, a copy of every cached key and
    value of the layer in every step: for OPT-1.3B at batch 16 (32 KV heads) ~48 cats of
    ~8.5 MB, a third of the step. Here a plain DynamicLayer of a plain DynamicCache keeps its
    keys and values as views `[:, :, :n]` of buffers with spare room along the sequence, and
    the token is written into the room. The layer's `keys` / `values` are still the tensors
    HF reads, with HF's shapes and values, so every Cache operation keeps working: a crop
    slices the same buffer (the next token overwrites what it dropped), and anything that
    rebinds them (a beam reorder, a batch selection, HF's own update) is noticed, because they
    no longer view the buffer, and the buffer is rebuilt from them. Any other cache, layer
    class or shape: HF's update, unchanged."""
    if not _plain_cache(cache) or layer_idx >= len(cache.layers):
        return cache.update(k, v, layer_idx)
    layer = cache.layers[layer_idx]
    held = _plain_layer(layer)
    if held is None:
        return cache.update(k, v, layer_idx)
    keys, values = held
    if (k.shape != (keys.shape[0], keys.shape[1], 1, keys.shape[3]) or v.shape != k.shape
            or k.dtype != keys.dtype or v.dtype != keys.dtype or k.device != keys.device
            or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))):
        return cache.update(k, v, layer_idx)
    n = keys.shape[2]
    room = _room(layer, keys, values, n)
    room[0][:, :, n:n + 1].copy_(k)
    room[1][:, :, n:n + 1].copy_(v)
    layer.keys, layer.values = room[0][:, :, :n + 1], room[1][:, :, :n + 1]
    return layer.keys, layer.values


def _plain_cache(cache: Any) -> bool:
    """A DynamicCache itself (not a subclass), not offloading, outside torch.compile tracing
    (the buffers' data-pointer checks would break the graph)."""
    return (type(cache) is DynamicCache and not cache.offloading
            and not torch.compiler.is_compiling())


def _plain_layer(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) of an initialized DynamicLayer itself holding two 4-D tensors of one
    shape, else None."""
    keys, values = layer.keys, layer.values
    if (type(layer) is not DynamicLayer or not layer.is_initialized
            or not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor)
            or keys.dim() != 4 or values.shape != keys.shape):
        return None
    return keys, values


def _room(layer: Any, keys: torch.Tensor, values: torch.Tensor, n: int):
    """The layer's (key buffer, value buffer) whose [:, :, :n] its keys / values view, with
    room for token n: the one it has, or a new one holding a copy of them."""
    room = layer.__dict__.get("_hfd_room")
    # a buffer made under torch.inference_mode() cannot be written outside it: a new one
    if room is None or not (_views(keys, room[0]) and _views(values, room[1])
                            and room[0].shape[2] > n) or (
            room[0].is_inference() and not torch.is_inference_mode_enabled()):
        b, h, _, d = keys.shape
        size = n + max(KV_SPARE_MIN, n // 4)
        room = (keys.new_empty(b, h, size, d), values.new_empty(b, h, size, d))
        room[0][:, :, :n].copy_(keys)
        room[1][:, :, :n].copy_(values)
        layer._hfd_room = room
    return room


def kv_rooms(cache: Any, count: int, kv_heads: int, head_dim: int):
    """For a batch-1 step that writes each layer's new key and value straight into the cache
    (kernels.decode.LayerChain): the (key buffer, value buffer) of layers 0..count-1 of a
    plain DynamicCache, made and checked as append_kv makes them, each with room for token n
    after the n cached ones, and n (the same in every layer). None where append_kv itself
    would take HF's update, or the layers hold something other than one sequence of bf16
    [1, kv_heads, n, head_dim] on the CPU. `commit_kv` then makes token n part of the cache."""
    if not _plain_cache(cache) or len(cache.layers) != count:
        return None
    rooms, n = [], None
    inference = torch.is_inference_mode_enabled()
    for layer in cache.layers:
        # the layer as commit_kv left it (the same key / value objects, views of its room):
        # the checks below held then, so only the room's length and mode are checked again
        # (the full checks were ~9 us per layer and token)
        committed = layer.__dict__.get("_hfd_committed")
        if (committed is not None and type(layer) is DynamicLayer
                and layer.keys is committed[0]() and layer.values is committed[1]()):
            room, m = layer._hfd_room, layer.keys.shape[2]
            if ((n is None or m == n) and room[0].shape[2] > m
                    and room[0].shape[1] == kv_heads and room[0].shape[3] == head_dim
                    and (inference or not room[0].is_inference())):
                rooms.append(room)
                n = m
                continue
        held = _plain_layer(layer)
        if held is None:
            return None
        keys, values = held
        if (keys.dtype != torch.bfloat16 or values.dtype != torch.bfloat16
                or keys.device.type != "cpu" or values.device.type != "cpu"
                or tuple(keys.shape[:2]) != (1, kv_heads) or keys.shape[3] != head_dim
                or (n is not None and keys.shape[2] != n)):
            return None
        n = keys.shape[2]
        rooms.append(_room(layer, keys, values, n))
    return rooms, n


def commit_kv(cache: Any, rooms: list, n: int) -> None:
    """After LayerChain.step wrote token n into every room: the layers' keys / values become
    [:, :, :n + 1] of their buffers, as append_kv leaves them."""
    for layer, (kb, vb) in zip(cache.layers, rooms):
        layer.keys, layer.values = kb.narrow(2, 0, n + 1), vb.narrow(2, 0, n + 1)
        # weak: once the layer holds other tensors (a crop, append_kv's own room), these views
        # must not keep the old room's memory alive
        layer._hfd_committed = (weakref.ref(layer.keys), weakref.ref(layer.values))


def _views(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """t is buffer[:, :, :n] for its n."""
    return (t.data_ptr() == buffer.data_ptr() and t.stride() == buffer.stride()
            and t.shape[:2] == buffer.shape[:2] and t.shape[3] == buffer.shape[3])


def _refuse_hf_forward_under_tp(named: dict[str, Any]) -> None:
    from hf_dsinfer.errors import TensorParallelError

    asked = [k for k in ("output_attentions", "encoder_hidden_states") if named.get(k)]
    raise TensorParallelError(
        "a tensor-parallel block was asked for what only the Hugging Face forward computes "
        f"({', '.join(asked) or 'training mode or a disabled fused block'}); that forward cannot "
        "run on sharded weights. Fix: call the model in eval mode without output_attentions, or "
        "load it with tp_size=1."
    )


def _add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


def _config_rotary_dim(attn: nn.Module, head_dim: int) -> int:
    """The rotated width of each head the attention's config gives (HF's default RoPE init:
    int(head_dim * partial_rotary_factor)); head_dim where it names no factor."""
    config = getattr(attn, "config", None)
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    return head_dim if factor is None else int(head_dim * factor)


def _gptj_cos_sin(attn: nn.Module, named: dict, dtype: torch.dtype):
    """GPT-J's sin / cos, [B, S, rotary_dim / 2] each, cast to the activations' dtype: gathered by
    the model's rotary module and passed as `position_embeddings` = (sin, cos) (transformers
    >= 5.24), or, before, gathered by position from the attention module's [max_pos,
    rotary_dim] table of [sin | cos] (policies/gptj.py). Returns interleaved cos, sin
    [B, S, rotary_dim]."""
    table = getattr(attn, "embed_positions", None)
    if table is None:
        sin, cos = (t.to(dtype) for t in named["position_embeddings"])
    else:
        position_ids = named["position_ids"]
        sin, cos = table.to(position_ids.device)[position_ids].to(dtype).chunk(2, dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
