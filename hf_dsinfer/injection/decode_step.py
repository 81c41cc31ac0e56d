"""A one-token decode step of a Llama-family or OPT model as one loop over its native layers.

HF's `LlamaModel.forward` calls every decoder layer as a module, and each fused block then checks
its call before the two native calls of kernels.decode. On a CPU the weight stream of each layer
evicts that Python's data from the caches, so those checks cost several times what they cost
warm (measured: docs/performance.md, "Behind the code"). `NativeDecodeStep`, installed as the inner model's
`forward`, takes the calls it can prove equal to HF's and runs them as:

    x = embed_tokens(input_ids); cos, sin = rotary_emb(x, position_ids)
    for each layer: q, k, v = attn_in(x, cos, sin); k, v = cache.update(k, v, i)
                    x = attn_out(x, q, k, v, keep)
    return norm(x)

(OPT: x = embed_tokens(input_ids), project_in, + embed_positions(positions from the mask), no
rotary; final_layer_norm and project_out at the end) with the HF cache's own `update` (any
Cache class) and every check done once per step: for one sequence with the batch-1 layer calls,
and for up to DECODE_MAX_ROWS sequences with the batched ones (attn_in_rows / attn_out_rows:
per-row positions and padding) when every layer's batched path runs (DecodeLayer.rows_why,
rows_max: bf16 projections or int8 row tiles on AMX; bf16, int8 or int4 without). One sequence in
a plain DynamicCache runs the whole layer loop as one native call (kernels.decode.LayerChain),
which writes each layer's key and value into the buffers append_kv keeps, with the same
numerics. The embedding and rotary modules are called as modules (their hooks run); the final
norm too, unless it is a hook-free RMSNorm of Llama's numerics of the blocks' norm class, which
the blocks' own norm kernel then computes (`final_norms` counts those steps).

Sliding layers (`config.layer_types`: Gemma 2 / 3; `sliding_window` without layer types, every
layer: Mistral, Phi-3) take the layer loop: a sliding layer's DynamicSlidingWindowLayer
returns its last min(keys, window) keys, which are exactly the keys HF's sliding mask lets the
token see, so that layer attends over them with the padding mask's last columns; Gemma 3's
rotary embedding is computed once per layer type, as its forward does.

Any call it cannot prove equal goes to HF's forward unchanged (which still runs the native layer
through each fused block): more than one token, a batch the batched layer does not take,
inputs_embeds, outputs or hooks asked of the layers, a mask other than "every cached key" or
plain padding, a cache layer of another kind than the layer's (a static sliding layer rolls its
keys), a layer whose native path is not built, grad,
torch.compile tracing. `reason()` says which.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_dsinfer.errors import NativeUnsupported
from hf_dsinfer.hf import cache_args, outputs
from hf_dsinfer.injection.fused import DECODE_MAX_ROWS, FusedBlock, commit_kv, kv_rooms
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels.decode import LayerChain

# inner model classes whose forward is exactly: embed, rotary, the decoder layers on one causal
# mask, norm (read in transformers 5.23). Qwen3 / SmolLM3 build a mask per layer type, the same
# causal mask or a sliding one per layer type (`_windows`); SmolLM3's NoPE layers are layers
# without RoPE (their native layer's rope is off); OLMo 2's cos / sin are fp32; Phi-3 rotates
# the first rotary_dim dims (partial_rotary_factor); Gemma's embedding module scales by
# sqrt(hidden) itself (GemmaTextScaledWordEmbedding, Gemma2TextScaledWordEmbedding, Gemma 3's,
# VaultGemma's); Ministral and Seed-OSS are Qwen2's and Llama's forward (transformers 5.24);
# Granite multiplies the embeddings (EMBEDDING_MULTIPLIERS); Gemma 3 computes a rotary
# embedding per layer type (ROPE_PER_LAYER_TYPE).
ROPE_MODEL_CLASSES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "Phi3Model",
                      "Olmo2Model", "SmolLM3Model", "GemmaModel", "GraniteModel", "Gemma2Model",
                      "Gemma3TextModel", "MinistralModel", "SeedOssModel", "VaultGemmaModel",
                      # Llama's forward, line for line (transformers 5.24)
                      "Ernie4_5Model", "HeliumModel", "GlmModel", "Glm4Model",
                      "HunYuanDenseV1Model", "ArceeModel", "StableLmModel", "Jais2Model",
                      # Mistral's, with an embedding dropout (identity: the step runs in eval)
                      "Starcoder2Model",
                      # Ministral's forward (masks by layer type), line for line
                      "Exaone4Model",
                      # Ministral's, but the layers get no use_cache and the output always
                      # the cache (the step runs only with use_cache on: the same outputs)
                      "CwmModel",
                      # Granite's forward, line for line
                      "HyperCLOVAXModel")
ROPE_PER_LAYER_TYPE = ("Gemma3TextModel",)  # rotary_emb(x, position_ids, layer_type)
# inner models whose forward the step does not reproduce, and why (their blocks still run the
# native layer one by one)
REFUSED_MODEL_CLASSES: dict[str, str] = {}
# inner model class -> its attribute the embeddings are multiplied by (HF: inputs_embeds * m)
EMBEDDING_MULTIPLIERS = {"GraniteModel": "embedding_multiplier",
                         "HyperCLOVAXModel": "embedding_multiplier"}
# OPT's decoder: embed, project_in, + learned positions (HF's cumsum of the mask, offset 2), the
# layers on one causal mask, final_layer_norm, project_out (transformers 5.x)
OPT_MODEL_CLASSES = ("OPTDecoder",)
MODEL_CLASSES = ROPE_MODEL_CLASSES + OPT_MODEL_CLASSES
# caches whose update appends this token's key after the `get_seq_length()` keys before it
CACHE_CLASSES = ("DynamicCache", "StaticCache")
CACHE_LAYER_CLASSES = ("DynamicLayer", "StaticLayer")  # of a layer without a window
SLIDING_LAYER_CLASSES = ("DynamicSlidingWindowLayer",)  # of a sliding layer
_PASSED = ("input_ids", "attention_mask", "position_ids", *cache_args.MODEL_NAMES, "inputs_embeds",
           "use_cache", "return_dict", "output_attentions", "output_hidden_states")


def _inert(hook: Any) -> bool:
    """transformers installs its output-capturing hook on the decoder layers at the first call
    that asks for hidden states and leaves it there; it does nothing while no capture is
    active (and this path runs only when none is asked for)."""
    return not outputs.capturing() and outputs.is_capture_hook(hook)


def _windows(config: Any, count: int) -> list[int | None] | str:
    """Each layer's sliding window (None: full attention) from `config.layer_types`, or why
    the step does not take this configuration."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:  # Mistral, Phi-3: a window, when set, for every layer (mask and cache)
        if window is not None and getattr(config, "use_sliding_window", True):
            return [window] * count if isinstance(window, int) and window > 0 else (
                "a sliding window that is not a positive integer")
        return [None] * count
    types = list(types)[:count]
    if len(types) != count or any(t not in ("full_attention", "sliding_attention") for t in types):
        return f"layer types other than full / sliding attention ({sorted(set(types))})"
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        return "sliding layers without a window"
    return [window if t == "sliding_attention" else None for t in types]


class NativeDecodeStep:
    """Callable installed as `inner.forward` (see the module docstring)."""

    def __init__(self, inner: nn.Module, blocks: list[FusedBlock]):
        self.inner = inner
        self.hf_forward = inner.forward  # the bound class forward
        self.blocks = blocks
        self.layers = [b.block for b in blocks]
        self.calls = 0  # steps taken natively
        self.chained = 0  # of those, steps run as one native call over every layer
        self.final_norms = 0  # of those, steps whose final norm the blocks' kernel computed
        self._layer_chain: LayerChain | None = None
        self._opt = type(inner).__name__ in OPT_MODEL_CLASSES  # learned positions, no rotary
        windows = _windows(inner.config, len(blocks))
        self.windows = windows if isinstance(windows, list) else None  # per layer
        # one native call over every layer needs full-attention cache layers
        self.chainable = self.windows is not None and all(w is None for w in self.windows)
        self._why_static = windows if isinstance(windows, str) else self._static_reason()
        self.last_reason: str | None = None  # why the last call went to HF's forward

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the chained native layers out (they point at this model's
        weights); the copy chains its own on its first step."""
        return {**self.__dict__, "_layer_chain": None}

    def _static_reason(self) -> str | None:
        inner = self.inner
        if type(inner).__name__ in REFUSED_MODEL_CLASSES:
            return f"{type(inner).__name__}: {REFUSED_MODEL_CLASSES[type(inner).__name__]}"
        if type(inner).__name__ not in MODEL_CLASSES:
            return f"{type(inner).__name__} is not one of {', '.join(MODEL_CLASSES)}"
        return next((b._decode_layout_why for b in self.blocks if b._decode_layout_why), None)

    def reason(self) -> str | None:
        """Why steps do not take this path (None: eligible calls do)."""
        if self._why_static is None and _native.lib() is None:
            return f"native kernels unavailable ({_native.why_unavailable()})"
        return self._why_static

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        why = self._why_static or self._refuse(args, kwargs)
        if why is None:
            sk = int(cache_args.model_cache(kwargs).get_seq_length()) + 1  # keys after the update
            rows = kwargs["input_ids"].shape[0]
            raw = self.inner.embed_tokens(kwargs["input_ids"])  # once: its hooks run once
            embedded = self._embed(kwargs, sk, raw)
            layers = None if embedded is None else self._native_layers(rows, embedded[1][0])
            keep = self._keep(kwargs.get("attention_mask"), rows, sk)
            if embedded is None:
                why = "not bf16, or positions of another shape"
            elif layers is None:
                why = ("a layer's native path is not built for its current weights" if rows == 1
                       else "a layer's batched native path does not run here")
            elif keep is False:
                why = "an attention mask other than padding"
            else:
                self.last_reason = None
                return self._step(layers, keep, sk, kwargs, embedded)
            # refused after embedding: HF's forward takes the embeddings instead of the ids
            # (it computes them from the ids only when none are given), not a second lookup
            kwargs = {**kwargs, "input_ids": None, "inputs_embeds": raw}
        self.last_reason = why
        return self.hf_forward(*args, **kwargs)

    # -- eligibility ---------------------------------------------------------------------------
    def _refuse(self, args: tuple, kwargs: dict) -> str | None:
        if args or any(k not in _PASSED for k in kwargs):
            return "arguments other than HF generate's"
        ids = kwargs.get("input_ids")
        cache = cache_args.model_cache(kwargs)
        if ids is None or kwargs.get("inputs_embeds") is not None:
            return "no input_ids"
        if (ids.dim() != 2 or not 1 <= ids.shape[0] <= DECODE_MAX_ROWS or ids.shape[1] != 1
                or ids.device.type != "cpu"):
            return f"not one token of 1-{DECODE_MAX_ROWS} sequences on the CPU"
        if cache is None or type(cache).__name__ not in CACHE_CLASSES:
            return "a cache other than DynamicCache / StaticCache"
        if int(cache.get_seq_length()) == 0:
            return "an empty cache"
        if len(cache.layers) != len(self.windows) or any(
                not _layer_kind_ok(layer, w) for layer, w in zip(cache.layers, self.windows)):
            return ("cache layers other than DynamicLayer / StaticLayer (full attention) and "
                    "DynamicSlidingWindowLayer (sliding, with the layer's window)")
        config = self.inner.config
        if kwargs.get("use_cache") is False or (kwargs.get("use_cache") is None
                                                and not config.use_cache):
            return "use_cache off"
        if kwargs.get("return_dict") is False:
            return "return_dict=False"
        if (kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
                or config.output_attentions or config.output_hidden_states):
            return "attentions or hidden states asked for"
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or self.inner.training:
            return "grad, training or torch.compile tracing"
        if _native.lib() is None:
            return f"native kernels unavailable ({_native.why_unavailable()})"
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return "global module hooks"
        for layer in self.layers:
            # accelerate's hook is an instance attribute (`"_hf_hook" in __dict__`: hasattr
            # went through Module.__getattr__'s AttributeError for every layer and step)
            if (layer._forward_pre_hooks or "_hf_hook" in layer.__dict__
                    or (layer._forward_hooks
                        and any(not _inert(h) for h in layer._forward_hooks.values()))):
                return "hooks on a decoder layer"
        return None

    def _native_layers(self, rows: int, cos: torch.Tensor | None) -> list | None:
        """Every block's native layer for cos / sin like `cos` (their dtype and width), or None."""
        rope_fp32 = cos is not None and cos.dtype == torch.float32
        rotary_dim = None if cos is None else cos.shape[-1]
        out = []
        for fused in self.blocks:
            layer = fused.decode_ready(rope_fp32, rotary_dim)
            if layer is None or (rows > 1 and (layer.rows_why is not None
                                               or rows > layer.rows_max)):
                return None
            out.append(layer)
        return out

    @staticmethod
    def _keep(mask: torch.Tensor | None, rows: int, sk: int) -> torch.Tensor | None | bool:
        """None: every one of the sk keys may be attended; the 2-D padding mask as uint8
        [rows, sk]; False: a mask this path does not take."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):  # a mask per layer type, prepared by the caller
            return False
        if (mask.dim() != 2 or mask.shape[0] != rows or mask.shape[1] != sk
                or torch.is_floating_point(mask)):  # a float 2-D mask is not a padding mask
            return False
        keep = mask if mask.dtype == torch.bool else mask != 0
        if bool(keep.all()):
            return None
        return keep.contiguous().view(torch.uint8)

    # -- the step ------------------------------------------------------------------------------
    def _chain(self, layers: list) -> LayerChain | None:
        """The one-call chain of these layers (rebuilt when a layer was)."""
        if self._layer_chain is None or not self._layer_chain.matches(layers):
            try:
                self._layer_chain = LayerChain(layers)
            except NativeUnsupported:
                return None
        return self._layer_chain

    def _embed(self, kwargs: dict, sk: int, raw: torch.Tensor):
        """(x, cos, sin) of this step as the inner model's forward computes them from the token
        embeddings `raw` (embed_tokens' output), or None."""
        if self._opt:
            return self._embed_opt(kwargs, sk, raw)
        return self._embed_rope(kwargs, sk, self.blocks[0].spec.head_dim, raw)

    def _embed_rope(self, kwargs: dict, sk: int, d: int, raw: torch.Tensor):
        """Llama-family: the token embeddings (times Granite's multiplier) and each layer's
        rotary cos / sin [rows or 1, r] (r <= d: partial rotary), bf16 or fp32 (OLMo 2), as
        lists (one per layer type, Gemma 3), or None where they are not of those shapes and
        dtypes."""
        inner = self.inner
        x = raw
        multiplier = EMBEDDING_MULTIPLIERS.get(type(inner).__name__)
        if multiplier is not None:
            x = x * getattr(inner, multiplier)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # HF's: the cache position, for every sequence
            position_ids = torch.tensor([[sk - 1]])
        if type(inner).__name__ in ROPE_PER_LAYER_TYPE:
            types = list(inner.config.layer_types)[:len(self.blocks)]
            per_type = {t: inner.rotary_emb(x, position_ids, t) for t in dict.fromkeys(types)}
        else:
            types = [None] * len(self.blocks)
            per_type = {None: inner.rotary_emb(x, position_ids=position_ids)}
        shaped = {}
        for t, (cos, sin) in per_type.items():
            r = cos.shape[-1]
            if (x.dtype != torch.bfloat16 or not 0 < r <= d
                    or cos.numel() not in (r, x.shape[0] * r)
                    or cos.dtype not in (torch.bfloat16, torch.float32)
                    or sin.dtype != cos.dtype or sin.shape != cos.shape):
                return None
            shaped[t] = (cos.reshape(-1, r).contiguous(), sin.reshape(-1, r).contiguous())
        if len({(c.dtype, c.shape[-1]) for c, _ in shaped.values()}) != 1:
            return None  # one native layer build per block: one dtype and width
        return (x.contiguous(), [shaped[t][0] for t in types], [shaped[t][1] for t in types])

    def _embed_opt(self, kwargs: dict, sk: int, raw: torch.Tensor):
        """OPT: embeddings (project_in) plus learned positions, as OPTDecoder.forward computes
        them for one token after sk - 1 cached ones (positions from the mask's cumsum)."""
        inner = self.inner
        ids = kwargs["input_ids"]
        x = raw
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(ids.shape[0], sk, device=x.device)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.cumsum(mask, dim=1)
            position_ids = (position_ids * mask - 1).long()[:, sk - 1:]
        pos = inner.embed_positions(mask, sk - 1, position_ids=position_ids)
        if inner.project_in is not None:
            x = inner.project_in(x)
        x = x + pos.to(x.device)
        none = [None] * len(self.blocks)
        return None if x.dtype != torch.bfloat16 else (x.contiguous(), none, none)

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner
        if self._opt:
            if inner.final_layer_norm is not None:
                x = inner.final_layer_norm(x)
            return x if inner.project_out is None else inner.project_out(x)
        norm = inner.norm
        if self._fused_final_norm(norm):
            # the final norm as the blocks compute their own norms of its class (the native
            # RMSNorm for bf16): one call instead of the module's six eager ops (timers around
            # _finish, SmolLM2 at the avx2 cap: 0.14-0.24 -> 0.10-0.13 ms, 2026-11-27)
            self.final_norms += 1
            return self.blocks[0]._norm(norm, x)
        return norm(x)

    def _fused_final_norm(self, norm: nn.Module) -> bool:
        """The model's final norm is an RMSNorm of Llama's numerics of the class the blocks'
        norms have (which they compute), with no hooks of its own."""
        first = self.blocks[0]
        if first.spec.norm != "rms" or first._ln1 is None:
            return False
        return (type(norm) is type(first._ln1) and not norm._forward_hooks
                and not norm._forward_pre_hooks and "_hf_hook" not in norm.__dict__)

    def _step(self, layers: list, keep: torch.Tensor | None, sk: int, kwargs: dict,
              embedded: tuple):
        cache = cache_args.model_cache(kwargs)
        d = self.blocks[0].spec.head_dim
        x, cos, sin = embedded  # cos / sin: per layer
        rows = x.shape[0]
        one_rope = all(c is cos[0] for c in cos) and all(s is sin[0] for s in sin)
        chain = self._chain(layers) if rows == 1 and one_rope and self.chainable else None
        got = None if chain is None else kv_rooms(cache, len(layers), chain.kv_heads, d)
        if got is not None and got[1] == sk - 1:  # one native call for every layer
            rooms, n = got
            x = chain.step(x, cos[0], sin[0], rooms, n,
                           None if keep is None else keep.reshape(-1))
            commit_kv(cache, rooms, n)
            for fused in self.blocks:
                fused.calls += 1
                fused.paths.took("step_chain")
            self.calls += 1
            self.chained += 1
            return BaseModelOutputWithPast(last_hidden_state=self._finish(x),
                                           **{cache_args.KEYWORD: cache})
        for i, (fused, layer) in enumerate(zip(self.blocks, layers)):
            # a sliding layer's cache returns its last min(sk, window) keys: those the token
            # sees (HF's sliding mask), with the padding mask's last columns
            window = self.windows[i]
            keys = sk if window is None else min(sk, window)
            kept = keep if keep is None or keys == sk else keep[:, sk - keys:].contiguous()
            x, path = fused.native_token(layer, x, cos[i], sin[i], cache, None, kept, keys)
            fused.paths.took("native_in" if path == "native_in" else "step_loop")
            fused.calls += 1
        self.calls += 1
        return BaseModelOutputWithPast(last_hidden_state=self._finish(x),
                                       **{cache_args.KEYWORD: cache})


def _layer_kind_ok(layer: Any, window: int | None) -> bool:
    """A cache layer this step updates as HF's forward would for a layer with `window`."""
    name = type(layer).__name__
    if window is None:
        return name in CACHE_LAYER_CLASSES
    return (name in SLIDING_LAYER_CLASSES and not getattr(layer, "record_past", False)
            and getattr(layer, "sliding_window", None) == window)


def install_decode_step(model: nn.Module, blocks: dict[str, FusedBlock],
                        layers_path: str) -> NativeDecodeStep | None:
    """Install on the module holding the decoder layers when every layer is a fused block whose
    layout the native decode layer computes on the CPU; None otherwise."""
    try:
        layers = model.get_submodule(layers_path)
    except AttributeError:
        return None
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    inner = model.get_submodule(parent_path)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    by_block = {id(f.block): f for f in blocks.values()}
    fused = [by_block.get(id(layer)) for layer in layers]
    if any(f is None or f.backend != "cpu" or f._decode_layout_why is not None for f in fused):
        return None
    names = (("embed_tokens", "embed_positions", "project_in", "final_layer_norm", "project_out")
             if type(inner).__name__ in OPT_MODEL_CLASSES else ("embed_tokens", "rotary_emb", "norm"))
    if any(not hasattr(inner, name) for name in names):
        return None
    if "forward" in inner.__dict__:  # someone else's forward is installed: leave it
        return None
    step = NativeDecodeStep(inner, fused)
    inner.forward = step
    return step


def uninstall_decode_step(step: NativeDecodeStep | None) -> None:
    if step is not None and step.inner.__dict__.get("forward") is step:
        del step.inner.forward
