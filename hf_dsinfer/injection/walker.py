"""Apply a policy to a model: install FusedBlocks on its decoder blocks, undo it, report it.
These are the injection layer's phases; hf_dsinfer.phases runs them in order with the
parallel and offload phases between them.

Installing means setting the instance attribute `block.forward` (or, when accelerate has hooked
the block, the `_old_forward` its hook calls). Nothing is patched on a class, so two injected
models (or an injected and a plain one) live in one process, and `revert` restores the block
exactly by removing the instance attribute.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from hf_dsinfer import settings, state
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import ParityError, UnsupportedModelError
from hf_dsinfer.hf import continuous_batching
from hf_dsinfer.hf.continuous_batching import ContinuousBatching
from hf_dsinfer.injection.decode_step import (
    NativeDecodeStep,
    install_decode_step,
    uninstall_decode_step,
)
from hf_dsinfer.injection.fused import FusedBlock, resolve_spec
from hf_dsinfer.injection.head import HeadReport, install_head, uninstall_head
from hf_dsinfer.injection.latency import (
    DecodeMode,
    disable_compiled_decode,
    enable_compiled_decode,
    resolve_decode_mode,
)
from hf_dsinfer.injection.layers import iter_layers, layers_path
from hf_dsinfer.injection.moe import (
    build_moe,
    install_moe,
    moe_group_size,
    quantize_moe,
    uninstall_moe,
)
from hf_dsinfer.injection.parity import ParityResult, run_parity_gate
from hf_dsinfer.injection.policies import find_policy, missing_features, supported_families
from hf_dsinfer.injection.policy import Policy
from hf_dsinfer.injection.quantize import (
    QuantSummary,
    block_group_size,
    check_quant_supported,
    quantize_blocks,
)
from hf_dsinfer.injection.scope import SettingsScope, install_settings, uninstall_settings
from hf_dsinfer.kernels._dispatch import resolve
from hf_dsinfer.kernels.quant import probe_private_ops

if TYPE_CHECKING:  # annotations only: parallel/ sits above injection
    from hf_dsinfer.parallel.expert import EPReport
    from hf_dsinfer.parallel.pipeline import PPReport
    from hf_dsinfer.parallel.tensor import TPReport


@dataclasses.dataclass
class InjectionReport:
    """What injection did to one model; stored on the model, printed by `explain`."""

    config: DSInferConfig
    model_class: str
    policy: Policy | None
    blocks: dict[str, FusedBlock] = dataclasses.field(default_factory=dict)  # path -> fused
    parity: dict[str, ParityResult] = dataclasses.field(default_factory=dict)  # class -> result
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> reason
    unmodified_reason: str | None = None
    quant: QuantSummary | None = None
    decode: DecodeMode | None = None
    tp: TPReport | None = None  # when tp_size > 1
    moe: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> FusedMoE
    moe_quant: tuple[int, int] | None = None  # expert weight bytes (before, after) quantization
    ep: EPReport | None = None  # when ep_size > 1
    pp: PPReport | None = None  # when pp_size > 1
    head: HeadReport | None = None  # the output projection on the kernel library, if it is
    step: NativeDecodeStep | None = None  # when installed
    serving: ContinuousBatching | None = None  # when installed
    backend: str | None = None  # the kernel backend the fused blocks run ("torch", "cpu", ...)
    settings: SettingsScope | None = None  # config.settings around the model's forward


def get_report(model: nn.Module) -> InjectionReport | None:
    return state.get(model, "report")


def begin(model: nn.Module, config: DSInferConfig) -> InjectionReport:
    """A fresh report for `model`, stored on it (hf_dsinfer.phases runs the rest)."""
    report = InjectionReport(config=config, model_class=type(model).__name__,
                             policy=find_policy(model))
    state.put(model, "report", report)
    return report


def prepare(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> bool:
    """Build a FusedBlock (and FusedMoE) for every supported decoder block and check what can
    be checked before anything is installed. False when the model is unsupported (strict=False:
    it runs unmodified, with the reason in the report; strict raises)."""
    policy = report.policy
    if policy is None or layers_path(model, policy) is None:
        _handle_unsupported(model, config, report)
        return False
    if (lacking := policy.lacking(model.config)) is not None:
        _handle_unsupported(model, config, report, lacking)
        return False
    report.backend = _model_backend(model, config)
    for path, index, block in iter_layers(model, policy):
        if type(block).__name__ not in policy.block_classes:
            report.skipped[path] = getattr(block, "skip_reason", None) or \
                f"{type(block).__name__} is not a {policy.family} block class"
            continue
        if config.offload is None and _offloaded_by_accelerate(block):
            report.skipped[path] = ACCELERATE_OFFLOADED
            continue
        spec = resolve_spec(block, policy, model.config, index)
        report.blocks[path] = FusedBlock(block, policy, spec, report.backend)
    _warn_accelerate_offloaded(report)
    report.moe = build_moe(report.blocks, model.config, config.moe_capacity_factor)
    _check_quant(model, config, report)  # fail before touching the model
    if config.quant is not None:
        moe_group_size(report.moe, config.quant)
    return True


def install(model: nn.Module, report: InjectionReport) -> None:
    """Put the fused blocks and MoE layers in place of HF's forwards, and the model's own
    settings (config.settings) around its forward."""
    report.settings = install_settings(model, report.config.settings)
    for fused in report.blocks.values():
        _install(fused.block, fused)
    install_moe(report.moe)


def check_parity(model: nn.Module, report: InjectionReport,
                 references: dict[str, Any] | None = None) -> None:
    """The parity gate, when the config asks for it: on whole weights (before sharding), or
    with `references` on a model loaded sharded (after its blocks are wired)."""
    if not report.config.parity_check or not report.blocks:
        return
    if references is None and _sharded_at_load(model):
        return  # its gate runs once the blocks are wired, against the loader's references
    _apply_parity(model, report, references)


def quantize(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    """Weight-only int8 / int4 of the fused blocks and MoE experts that stay enabled."""
    if config.quant is None:
        return
    live = [f for f in report.blocks.values() if f.enabled]
    report.quant = quantize_blocks(live, config.quant)
    live_moe = {p: m for p, m in report.moe.items() if m.enabled}
    report.moe_quant = quantize_moe(live_moe, config.quant) if live_moe else None
    param = next(model.parameters())
    if param.device.type == "cpu":
        probe_private_ops(config.quant.bits, param.dtype)


def finish(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    """The model-level paths over the fused blocks: output head, one-loop decode step,
    continuous batching, compiled decode."""
    if report.blocks:
        report.head = install_head(model, config, report.backend)
    single = config.tp_size == config.ep_size == config.pp_size == 1
    if report.blocks and single and config.offload is None:
        report.step = install_decode_step(model, report.blocks,
                                          layers_path(model, report.policy))
    if report.blocks and config.pp_size == 1:
        report.serving = continuous_batching.install(model, list(report.blocks.values()))
    report.decode = resolve_decode_mode(config, next(model.parameters()).device)
    if report.decode.compile or report.decode.cache == "static":
        enable_compiled_decode(model, report.decode)


def drop_blocks(report: InjectionReport, paths: list[str]) -> None:
    """Give these blocks their HF forward back and forget them (and their MoE layers): a
    pipeline stage keeps only its own layers."""
    for path in paths:
        fused = report.blocks.pop(path)
        _uninstall(fused.block, fused)
        for moe_path in [m for m in report.moe if m.startswith(f"{path}.")]:
            del report.moe[moe_path]


def release_moe(report: InjectionReport) -> None:
    """Give the MoE layers their HF forwards back; raises first (nothing changed) when their
    experts are quantized or sharded."""
    uninstall_moe(report.moe)


def remove(model: nn.Module, report: InjectionReport) -> None:
    """Take off what `install` and `finish` put on (after release_moe)."""
    uninstall_settings(report.settings)
    uninstall_head(model, report.head)
    uninstall_decode_step(report.step)
    continuous_batching.uninstall(report.serving)
    for fused in report.blocks.values():
        _uninstall(fused.block, fused)
    disable_compiled_decode(model)
    state.put(model, "report", None)


# -- helpers -------------------------------------------------------------------------------------
ACCELERATE_OFFLOADED = (
    "weights offloaded by accelerate (device_map 'cpu'/'disk'): its hooks load them one "
    "submodule at a time, which a fused block would bypass, so the HF forward runs. For "
    "streamed offload with fused blocks use dsinfer={'offload': {...}}")


def _offloaded_by_accelerate(block: nn.Module) -> bool:
    """Some parameter is a meta placeholder that an accelerate hook fills per forward."""
    return any(p.device.type == "meta" for p in block.parameters()) and any(
        hasattr(m, "_hf_hook") for m in block.modules())


def _warn_accelerate_offloaded(report: InjectionReport) -> None:
    paths = [p for p, why in report.skipped.items() if why is ACCELERATE_OFFLOADED]
    if paths:
        warnings.warn(f"hf_dsinfer: {len(paths)} decoder block(s) ({paths[0]} ...) keep the HF "
                      f"forward: {ACCELERATE_OFFLOADED}.", stacklevel=5)


def _handle_unsupported(model: nn.Module, config: DSInferConfig, report: InjectionReport,
                        lacking: str | None = None) -> None:
    model_type = getattr(model.config, "model_type", "?")
    if lacking is not None:  # a policy's family, in a configuration its blocks cannot compute
        why = f"the {report.policy.family} policy lacks {lacking}"
        message = (
            f"hf_dsinfer cannot fuse {type(model).__name__}: the fused block lacks {lacking}. "
            "Fix: pass strict=False to run this model unmodified.")
        report.policy = None
    elif report.policy is None:
        families = ", ".join(f"{f} ({'/'.join(t)})" for f, t in supported_families().items())
        why = f"no policy for model_type={model_type!r}"
        message = (
            f"hf_dsinfer has no injection policy for {type(model).__name__} "
            f"(config.model_type={model_type!r}). {missing_features(model_type)} "
            f"Supported families (model_type): {families}. "
            "Fix: use a supported model, or pass strict=False to run this model unmodified.")
    else:
        tail = report.policy.layers.split(".", 1)[1]
        why = f"{type(model).__name__} holds no decoder layers at {report.policy.layers!r}"
        message = (
            f"hf_dsinfer found no decoder layers in {type(model).__name__}: the "
            f"{report.policy.family} policy looks for {report.policy.layers!r} (or {tail!r} under "
            "the model's base_model_prefix). Fix: pass strict=False to run this model "
            "unmodified, or inject its base model (model.base_model).")
        report.policy = None
    if config.strict is False:
        report.unmodified_reason = f"{why}; running unmodified"
        warnings.warn(report.unmodified_reason, stacklevel=4)
        return
    state.put(model, "report", None)
    raise UnsupportedModelError(message)


def _sharded_at_load(model: nn.Module) -> bool:
    """Loaded with only this rank's slices or pipeline stage (hf_dsinfer.parallel): no HF
    forward to compare."""
    return state.get(model, "tp_plan") is not None or state.get(model, "pp_stages") is not None


def _check_quant(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    if config.quant is None:
        return
    param = next(model.parameters())
    check_quant_supported(config.quant, param.device, param.dtype)
    block_group_size(list(report.blocks.values()), config.quant)


def _model_backend(model: nn.Module, config: DSInferConfig) -> str:
    """The backend the fused blocks run: the config's, or for "auto" what HF_DSINFER_KERNELS
    names (default auto: Triton on CUDA, the CPU paths on CPU)."""
    param = next(model.parameters())
    if config.kernels != "auto":
        return config.kernels
    with settings.use(**(config.settings or {})):
        return resolve(None, param.device)


def _install(block: nn.Module, fused: FusedBlock) -> None:
    if hasattr(block, "_hf_hook"):  # accelerate's hook wraps forward and calls _old_forward
        block._old_forward = fused
    else:
        block.forward = fused


def _uninstall(block: nn.Module, fused: FusedBlock) -> None:
    if hasattr(block, "_hf_hook") and getattr(block, "_old_forward", None) is fused:
        block._old_forward = fused.hf_forward
    elif block.__dict__.get("forward") is fused:
        del block.forward


def _apply_parity(model: nn.Module, report: InjectionReport,
                  references: dict[str, Any] | None) -> None:
    report.parity = run_parity_gate(model, report.blocks, references)
    failed = {name: r for name, r in report.parity.items() if not r.passed}
    if not failed:
        return
    detail = "; ".join(f"{name}: {r.summary()}" for name, r in failed.items())
    cfg = report.config
    if references is not None:
        raise ParityError(
            f"tensor-parallel fused blocks disagree with their Hugging Face originals: {detail}. "
            "There is no HF fallback on sharded weights. Fix: report this with the model config; "
            "load with tp_size=1.")
    if cfg.strict or cfg.tp_size > 1 or cfg.ep_size > 1:  # no HF fallback on sharded weights
        raise ParityError(  # hf_dsinfer.phases takes the injection off
            f"fused blocks disagree with their Hugging Face originals beyond tolerance: {detail}. "
            "The model was left unmodified. Fix: report this with the model config; pass "
            "strict=None to keep the HF blocks for the failing classes and fuse the rest."
        )
    for fused in report.blocks.values():
        if type(fused.block).__name__ in failed:
            fused.enabled = False
    warnings.warn(f"hf_dsinfer: parity gate failed, keeping HF forward for {detail}", stacklevel=4)
