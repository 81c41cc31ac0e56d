"""DSInferConfig: the one frozen, validated configuration object of hf_dsinfer.

Every field is used; an unknown key, a wrong type or an impossible value fails at construction
with what was expected, what was given and how to fix it. The config round-trips through JSON
(`to_dict` / `from_dict`, `to_json` / `from_json`) because it is saved into a model's
config.json as its `quantization_config` and re-applied on reload.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable
from typing import Any

import torch

from hf_dsinfer.errors import DSInferConfigError
from hf_dsinfer.kernels._dispatch import BACKENDS
from hf_dsinfer.kernels.quant import INT4_GROUP_SIZES
from hf_dsinfer.offload.policy import OffloadPolicy
from hf_dsinfer.settings import coerce as settings_coerce

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> torch.dtype | None:
    """Accept a torch.dtype, its name ("bfloat16", "bf16", "torch.bfloat16") or None."""
    if value is None or isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name in _DTYPES:
            return _DTYPES[name]
    raise DSInferConfigError(
        f"DSInferConfig.dtype: expected one of {sorted(_DTYPES)} (or a torch dtype, or None to "
        f"keep the model's dtype), got {value!r}. Fix: e.g. dtype=torch.bfloat16 or dtype='bfloat16'."
    )


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of the decoder blocks' linear layers, applied at load.

    Attributes:
        bits: 8 (int8 per output channel, ZeroQuant-style) or 4 (4-bit group-wise).
        group_size: int4 group length along the input dim, one of 32/64/128/256; None picks the
            smallest that divides every quantized layer's input size. Ignored for int8.
        symmetric: int4 only: absmax (symmetric) instead of FlexGen's min-max groups.
        act_bits: 16 (default): the activations stay in the model's dtype, and a quantized
            linear computes x @ dequantize(W).T. 8, with bits=4 (W4A8): each row of x is
            quantized to 8 bits per weight group (absmax / 127) and multiplied with the 4-bit
            codes in integer sums (kernels/quant.py: linear_int4_a8_ref), which CPUs with
            AVX-512 VNNI run at about twice the rate of bf16 products: for batched decoding and
            continuous batching, where the products, not the weight reads, are the bound. Other
            numbers than HF's (docs/performance.md has the perplexity it costs), the same at
            every row count: the native batch-1 decode layer runs it with the batched kernel's
            bits, at 0.7-0.9x the batch-1 speed of act_bits=16 (docs/performance.md).
    """

    bits: int
    group_size: int | None = None
    symmetric: bool = False
    act_bits: int = 16

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            raise DSInferConfigError(
                f"DSInferConfig.quant.bits: expected 8 or 4, got {self.bits!r}. "
                "Fix: quant={'bits': 8} (int8 weights) or quant={'bits': 4, 'group_size': 128}."
            )
        if self.group_size is not None and self.group_size not in INT4_GROUP_SIZES:
            raise DSInferConfigError(
                f"DSInferConfig.quant.group_size: expected one of {INT4_GROUP_SIZES} or None "
                f"(auto), got {self.group_size!r}. Fix: group_size=128, or leave it out."
            )
        _check_type("quant.symmetric", self.symmetric, (bool,), "True or False")
        if self.act_bits not in (16, 8) or isinstance(self.act_bits, bool):
            raise DSInferConfigError(
                f"DSInferConfig.quant.act_bits: expected 16 (activations in the model's dtype) "
                f"or 8 (W4A8), got {self.act_bits!r}. Fix: quant={{'bits': 4, 'act_bits': 8}}, "
                "or leave act_bits out."
            )
        if self.act_bits == 8 and self.bits != 4:
            raise DSInferConfigError(
                f"DSInferConfig.quant.act_bits=8 is built for 4-bit weights, got bits="
                f"{self.bits}. Fix: quant={{'bits': 4, 'act_bits': 8}}, or drop act_bits for "
                "int8 weights."
            )

    @classmethod
    def coerce(cls, value: Any) -> QuantConfig | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            _reject_unknown(cls, value, "DSInferConfig.quant")
            return cls(**value)
        raise DSInferConfigError(
            f"DSInferConfig.quant: expected None or a dict like {{'bits': 8}}, got {value!r}. "
            "Fix: quant={'bits': 8} or quant={'bits': 4, 'group_size': 128}."
        )


@dataclasses.dataclass(frozen=True)
class DSInferConfig:
    """How hf_dsinfer transforms a model.

    Attributes:
        dtype: compute/weight dtype to convert the model to; None keeps the model's dtype.
        kernels: kernel backend for the fused blocks: "auto" (Triton on CUDA, CPU fast paths on
            CPU), "ref" (plain torch), "triton", or "cpu".
        strict: what to do when something cannot be fused exactly.
            None (default): an unsupported architecture raises UnsupportedModelError; a block
                that fails the parity gate keeps its HF forward and a warning is issued.
            True: both raise (UnsupportedModelError / ParityError).
            False: an unsupported model runs unmodified; a failed block falls back with a warning.
            `hf_dsinfer.explain(model)` reports every decision.
        parity_check: run each fused block class once on a probe (prefill + one cached decode
            step) against its HF original at injection time.
        quant: weight-only quantization of the fused blocks' linears (QuantConfig or a dict
            like {"bits": 8}); applied after the parity gate has checked the unquantized blocks.
        compile: capture the whole decode step: generate() uses a preallocated static KV cache
            and a torch.compile'd forward for every decode step (prefill stays eager; CUDA
            graphs on a GPU). None (default) = auto: off; on only when asked (True). On CPU a
            first call of tens of seconds buys little decode speed (docs/performance.md); on
            the first GPU measured (an H200, torch 2.11) the compiled step ran at 0.14x HF eager
            where the eager fused step ran at 0.96x (docs/gpu.md). Never with tp_size /
            ep_size / offload.
        cache: "static" (a preallocated KV cache, as the compiled decode step needs), "dynamic"
            (HF's growing DynamicCache), or None (default): static exactly when compiling.
        tp_size: tensor-parallel degree (Megatron-style slicing of every block, the embedding
            and lm_head). > 1 needs torch.distributed (torchrun / accelerate launch); the world
            size and the heads are checked when the model is injected.
        offload: FlexGen offloading (hf_dsinfer.offload.OffloadPolicy or a dict of its fields):
            weights / KV cache / activations placed on the compute device, the CPU and disk,
            run by the block schedule with prefetching; None (default) keeps the model as is.
        ep_size: expert-parallel degree for mixture-of-experts models: each rank keeps
            E / ep_size experts (or, with more ranks than experts, a 1 / (ep_size / E) slice
            of one expert's FFN) and tokens travel to their experts by all-to-all. Ranks run
            their own batches (data parallel); generate() keeps finished ranks stepping.
            Needs torch.distributed with ep_size processes (or ep_size * tp_size with tp_size).
            Inside a pipeline (pp_size) every stage shards its own experts over its ranks.
        ep_node_size: hierarchical all-to-all: ranks per node. Tokens first move inside the
            node, then between nodes among ranks with the same local index (fewer, larger
            messages across nodes). None (default): one flat all-to-all.
        settings: None (default: the process's hf_dsinfer.settings, from the environment) or
            a dict changing them for this model only, e.g. {"native": False} (torch paths),
            {"isa": "avx2", "amx": False}, {"kernels": "ref"}; applied around the model's
            forward, so every kernel call inside it sees them.
        pp_size: pipeline-parallel degree (DeepSpeed-Inference's inference pipeline): the
            decoder layers are split into pp_size stages balanced by bytes, each rank loads and
            runs only its stage (the embedding on the first, the final norm and lm_head on the
            last) and keeps the KV cache of its own layers. Combines with tp_size and, for MoE
            models, ep_size (world = tp_size * ep_size * pp_size; stage k is the w = tp_size *
            ep_size ranks [k*w, (k+1)*w), which shard its layers and experts among them).
            Needs torch.distributed with gloo (CPU); NCCL pipelines are refused (unverified).
        pp_micro_batches: micro-batches of the generation phase (None: pp_size, the paper's
            choice); a micro-batch's next token goes back to the first stage as soon as the
            last stage samples it (dynamic queue, no per-token barrier).
        pp_prompt_micro_batches: micro-batches of the prompt phase (None: 2 * the generation
            phase's, the hybrid schedule: prompts are long, so more micro-batches fill the
            pipeline better); at least pp_micro_batches.
        pp_timeout_s: how long a pipeline rank waits for a message from its neighbour before it
            raises PipelineParallelError (a stage that raises tells the others at once).
        moe_capacity_factor: None (default) routes dropless, exactly as HF. A number c caps each
            expert at ceil(c * tokens * top_k / experts) routed tokens per forward; the rest
            of those tokens' slots are dropped (they keep only their other experts and the
            residual) - lossy, an explicit opt-in only.
    """

    dtype: torch.dtype | None = None
    kernels: str = "auto"
    strict: bool | None = None
    parity_check: bool = True
    quant: QuantConfig | None = None
    compile: bool | None = None
    cache: str | None = None
    tp_size: int = 1
    offload: OffloadPolicy | None = None
    ep_size: int = 1
    ep_node_size: int | None = None
    moe_capacity_factor: float | None = None
    settings: dict[str, Any] | None = None
    pp_size: int = 1
    pp_micro_batches: int | None = None
    pp_prompt_micro_batches: int | None = None
    pp_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "settings", settings_coerce(self.settings))
        object.__setattr__(self, "quant", QuantConfig.coerce(self.quant))
        _check_type("compile", self.compile, (bool, type(None)), "True, False or None")
        _check_cache(self.cache)
        if self.kernels not in BACKENDS:
            raise DSInferConfigError(
                f"DSInferConfig.kernels: expected one of {BACKENDS}, got {self.kernels!r}. "
                "Fix: kernels='auto' picks the fastest correct backend for the device."
            )
        _check_type("strict", self.strict, (bool, type(None)), "True, False or None")
        _check_type("parity_check", self.parity_check, (bool,), "True or False")
        _check_tp_size(self.tp_size)
        object.__setattr__(self, "offload", OffloadPolicy.coerce(self.offload))
        _check_moe(self)
        _check_pipeline(self)
        check_combinations(self)

    # -- construction from user input -----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSInferConfig:
        if not isinstance(data, dict):
            raise DSInferConfigError(
                f"DSInferConfig.from_dict: expected a dict, got {type(data).__name__}."
            )
        _reject_unknown(cls, data, "DSInferConfig")
        return cls(**data)

    @classmethod
    def coerce(cls, value: Any) -> DSInferConfig:
        """Turn what a user may pass as `dsinfer=` into a DSInferConfig."""
        if isinstance(value, cls):
            return value
        if value is True or value is None:
            return cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise DSInferConfigError(
            f"dsinfer=: expected True, a dict or a DSInferConfig, got {type(value).__name__} "
            f"({value!r}). Fix: dsinfer=True, dsinfer={{'dtype': 'bfloat16'}} or "
            "dsinfer=hf_dsinfer.DSInferConfig(...)."
        )

    def replace(self, **overrides: Any) -> DSInferConfig:
        return self.from_dict({**self.to_dict(), **overrides})

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["dtype"] = None if self.dtype is None else _dtype_name(self.dtype)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DSInferConfig:
        return cls.from_dict(json.loads(text))


def _reject_unknown(cls: type, data: dict[str, Any], where: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise DSInferConfigError(f"{where}: unknown key {key!r}.{hint} Valid keys: {names}.")


CACHES = ("static", "dynamic")


def _check_cache(cache: Any) -> None:
    if cache is not None and cache not in CACHES:
        raise DSInferConfigError(
            f"DSInferConfig.cache: expected one of {CACHES} or None (auto), got {cache!r}. "
            "Fix: cache='dynamic' to keep HF's growing cache, or leave it None."
        )


def _check_tp_size(tp_size: Any) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise DSInferConfigError(
            f"DSInferConfig.tp_size: expected a positive int, got {tp_size!r}. "
            "Fix: tp_size=1 (no tensor parallelism) or the number of processes per model, "
            "e.g. tp_size=2 under `torchrun --nproc-per-node 2`."
        )



def _check_moe(config: DSInferConfig) -> None:
    ep, node, cap = config.ep_size, config.ep_node_size, config.moe_capacity_factor
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise DSInferConfigError(
            f"DSInferConfig.ep_size: expected a positive int, got {ep!r}. Fix: ep_size=1 (no "
            "expert parallelism) or the number of processes sharing the experts, e.g. ep_size=2 "
            "under `torchrun --nproc-per-node 2`.")
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 1
                             or ep % node or node == ep):
        raise DSInferConfigError(
            f"DSInferConfig.ep_node_size: expected None or a proper divisor of ep_size={ep} "
            f"(ranks per node), got {node!r}. Fix: leave it None for one flat all-to-all, or "
            "e.g. ep_size=4, ep_node_size=2.")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or not cap > 0):
        raise DSInferConfigError(
            f"DSInferConfig.moe_capacity_factor: expected None (dropless, the default) or a "
            f"positive number, got {cap!r}. Fix: leave it None, or e.g. 1.25 to drop routed "
            "tokens beyond 1.25x an even share per expert.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_pipeline(config: DSInferConfig) -> None:
    pp, mb, prompt = config.pp_size, config.pp_micro_batches, config.pp_prompt_micro_batches
    if not _positive_int(pp):
        raise DSInferConfigError(
            f"DSInferConfig.pp_size: expected a positive int, got {pp!r}. Fix: pp_size=1 (no "
            "pipeline) or the number of stages, e.g. pp_size=2 under `torchrun "
            "--nproc-per-node 2` (tp_size * pp_size processes in all).")
    for name, value in (("pp_micro_batches", mb), ("pp_prompt_micro_batches", prompt)):
        if value is not None and not _positive_int(value):
            raise DSInferConfigError(
                f"DSInferConfig.{name}: expected None (automatic) or a positive int, got "
                f"{value!r}. Fix: leave it None, or e.g. {name}=4.")
    if mb is not None and prompt is not None and prompt < mb:
        raise DSInferConfigError(
            f"DSInferConfig: pp_prompt_micro_batches={prompt} is smaller than pp_micro_batches="
            f"{mb}; each generation micro-batch is made of whole prompt micro-batches. Fix: "
            f"pp_prompt_micro_batches >= {mb}, or leave it None.")
    timeout = config.pp_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise DSInferConfigError(
            f"DSInferConfig.pp_timeout_s: expected a positive number of seconds, got "
            f"{timeout!r}. Fix: leave it at 300, or e.g. pp_timeout_s=60.")


def _check_type(name: str, value: Any, types: tuple[type, ...], expected: str) -> None:
    if not isinstance(value, types):
        raise DSInferConfigError(
            f"DSInferConfig.{name}: expected {expected}, got {value!r} "
            f"({type(value).__name__}). Fix: pass {name}={expected.split(',')[0]}."
        )


# -- which features combine: one table, checked once, when the config is built -----------------
@dataclasses.dataclass(frozen=True)
class Conflict:
    """Two features that cannot run together, why, and what to drop."""

    first: str  # a feature name of FEATURES
    second: str
    why: str
    fix: str


FEATURES: dict[str, Callable[[DSInferConfig], bool]] = {
    "compile=True": lambda c: bool(c.compile),
    "cache='dynamic'": lambda c: c.cache == "dynamic",
    "cache='static'": lambda c: c.cache == "static",
    "quant": lambda c: c.quant is not None,
    "tp_size > 1": lambda c: c.tp_size > 1,
    "ep_size > 1": lambda c: c.ep_size > 1,
    "offload": lambda c: c.offload is not None,
    "pp_size > 1": lambda c: c.pp_size > 1,
}
_OFFLOAD_WHY = ("offloaded weights are streamed per layer and compressed by the offload engine "
                "itself, and generate() gets the offload engine's own per-micro-batch cache")
_PIPELINE_WHY = ("each pipeline stage keeps a growing per-micro-batch cache of its own layers and "
                 "runs eagerly")
CONFLICTS: tuple[Conflict, ...] = (
    Conflict("compile=True", "cache='dynamic'", "a compiled decode step has fixed shapes: it "
             "needs the preallocated static KV cache", "drop one of the two"),
    Conflict("compile=True", "tp_size > 1", "the captured decode step would contain the "
             "tensor-parallel collectives", "drop compile=True or use tp_size=1"),
    Conflict("compile=True", "ep_size > 1", "the expert all-to-all needs every rank in eager "
             "lockstep", "drop compile=True or use ep_size=1"),
    Conflict("compile=True", "offload", _OFFLOAD_WHY, "drop compile=True"),
    Conflict("quant", "offload", _OFFLOAD_WHY,
             "drop quant; use offload={'compress_weights': True} for 4-bit weights"),
    Conflict("tp_size > 1", "offload", _OFFLOAD_WHY, "drop tp_size or offload"),
    Conflict("cache='static'", "offload", _OFFLOAD_WHY, "drop cache='static'"),
    Conflict("ep_size > 1", "offload", "the expert all-to-all needs every rank in eager "
             "lockstep", "drop offload or use ep_size=1"),
    Conflict("pp_size > 1", "compile=True", _PIPELINE_WHY, "drop compile=True or use pp_size=1"),
    Conflict("pp_size > 1", "cache='static'", _PIPELINE_WHY,
             "drop cache='static' or use pp_size=1"),
    Conflict("pp_size > 1", "offload", _PIPELINE_WHY, "drop offload or use pp_size=1"),
)


def check_combinations(config: DSInferConfig) -> None:
    """Raise for the first pair of features in CONFLICTS that the config turns on together."""
    for conflict in CONFLICTS:
        if FEATURES[conflict.first](config) and FEATURES[conflict.second](config):
            raise DSInferConfigError(
                f"DSInferConfig: {conflict.first} cannot be combined with {conflict.second} "
                f"(tp_size={config.tp_size}, ep_size={config.ep_size}, pp_size={config.pp_size}):"
                f" {conflict.why}. "
                f"Fix: {conflict.fix}.")
