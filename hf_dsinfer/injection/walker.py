"""Apply a policy to a model: install FusedBlocks on its decoder blocks, undo it, report it.

Installing means setting the instance attribute `block.forward` (or, when accelerate has hooked
the block, the `_old_forward` its hook calls). Nothing is patched on a class, so two injected
models (or an injected and a plain one) live in one process, and `revert` restores the block
exactly by removing the instance attribute.
"""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import ParityError, UnsupportedModelError
from hf_dsinfer.injection.fused import FusedBlock, resolve_spec
from hf_dsinfer.injection.latency import disable_compiled_decode, enable_compiled_decode
from hf_dsinfer.injection.parity import ParityResult, run_parity_gate
from hf_dsinfer.injection.policies import find_policy, supported_families
from hf_dsinfer.injection.policy import Policy
from hf_dsinfer.injection.quantize import (
    QuantSummary,
    block_group_size,
    check_quant_supported,
    quantize_blocks,
)
from hf_dsinfer.kernels._dispatch import resolve

REPORT_ATTR = "_dsinfer_report"


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


def get_report(model: nn.Module) -> InjectionReport | None:
    return getattr(model, REPORT_ATTR, None)


def inject(model: nn.Module, config: DSInferConfig) -> InjectionReport:
    """Fuse every supported decoder block of `model` in place and run the parity gate."""
    if get_report(model) is not None:
        revert(model)
    policy = find_policy(model)
    report = InjectionReport(config=config, model_class=type(model).__name__, policy=policy)
    setattr(model, REPORT_ATTR, report)
    if policy is None:
        _handle_unsupported(model, config, report)
        return report
    backend = _model_backend(model, config)
    for path, index, block in _blocks(model, policy):
        if type(block).__name__ not in policy.block_classes:
            report.skipped[path] = f"{type(block).__name__} is not a {policy.family} block class"
            continue
        spec = resolve_spec(block, policy, model.config, index)
        report.blocks[path] = FusedBlock(block, policy, spec, backend)
    try:
        _check_quant(model, config, report)  # fail before touching the model
    except ValueError:
        delattr(model, REPORT_ATTR)
        raise
    for fused in report.blocks.values():
        _install(fused.block, fused)
    if config.parity_check and report.blocks:
        _apply_parity(model, report)
    if config.quant is not None:
        live = [f for f in report.blocks.values() if f.enabled]
        report.quant = quantize_blocks(live, config.quant)
    if config.compile:
        enable_compiled_decode(model)
    return report


def revert(model: nn.Module) -> nn.Module:
    """Undo `inject`: every block gets its HF forward back (quantized linears stay quantized:
    dequantizing is lossy, and they remain ordinary callable modules). Returns the model."""
    report = get_report(model)
    if report is None:
        return model
    for fused in report.blocks.values():
        _uninstall(fused.block, fused)
    disable_compiled_decode(model)
    delattr(model, REPORT_ATTR)
    return model


# -- helpers -------------------------------------------------------------------------------------
def _handle_unsupported(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    model_type = getattr(model.config, "model_type", "?")
    families = ", ".join(f"{f} ({'/'.join(t)})" for f, t in supported_families().items())
    message = (
        f"hf_dsinfer has no injection policy for {type(model).__name__} "
        f"(config.model_type={model_type!r}). Supported families (model_type): {families}. "
        "Fix: use a supported model, or pass strict=False to run this model unmodified."
    )
    if config.strict is False:
        report.unmodified_reason = f"no policy for model_type={model_type!r}; running unmodified"
        warnings.warn(report.unmodified_reason, stacklevel=3)
        return
    delattr(model, REPORT_ATTR)
    raise UnsupportedModelError(message)


def _check_quant(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    if config.quant is None:
        return
    param = next(model.parameters())
    check_quant_supported(config.quant, param.device, param.dtype)
    block_group_size(list(report.blocks.values()), config.quant)


def _model_backend(model: nn.Module, config: DSInferConfig) -> str:
    param = next(model.parameters())
    return resolve(config.kernels, param.device) if config.kernels == "auto" else config.kernels


def _blocks(model: nn.Module, policy: Policy):
    container = _find_layers(model, policy.layers)
    prefix = policy.layers if _has_path(model, policy.layers) else policy.layers.split(".", 1)[1]
    for index, block in enumerate(container):
        yield f"{prefix}.{index}", index, block


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _find_layers(model: nn.Module, path: str) -> nn.ModuleList:
    """`path` is relative to the *ForCausalLM; accept the bare base model too."""
    if _has_path(model, path):
        return model.get_submodule(path)
    tail = path.split(".", 1)[1] if "." in path else path
    return model.get_submodule(tail)


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


def _apply_parity(model: nn.Module, report: InjectionReport) -> None:
    report.parity = run_parity_gate(model, list(report.blocks.values()))
    failed = {name: r for name, r in report.parity.items() if not r.passed}
    if not failed:
        return
    detail = "; ".join(f"{name}: {r.summary()}" for name, r in failed.items())
    if report.config.strict:
        revert(model)
        raise ParityError(
            f"fused blocks disagree with their Hugging Face originals beyond tolerance: {detail}. "
            "The model was left unmodified. Fix: report this with the model config; pass "
            "strict=None to keep the HF blocks for the failing classes and fuse the rest."
        )
    for fused in report.blocks.values():
        if type(fused.block).__name__ in failed:
            fused.enabled = False
    warnings.warn(f"hf_dsinfer: parity gate failed, keeping HF forward for {detail}", stacklevel=3)
