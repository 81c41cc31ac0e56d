"""Apply a policy to a model: install FusedBlocks on its decoder blocks, undo it, report it.

Installing means setting the instance attribute `block.forward` (or, when accelerate has hooked
the block, the `_old_forward` its hook calls). Nothing is patched on a class, so two injected
models (or an injected and a plain one) live in one process, and `revert` restores the block
exactly by removing the instance attribute.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import DSInferError, ParityError, UnsupportedModelError
from hf_dsinfer.injection.decode_step import install_decode_step, uninstall_decode_step
from hf_dsinfer.injection.fused import FusedBlock, resolve_spec
from hf_dsinfer.injection.head import HeadReport, install_head, uninstall_head
from hf_dsinfer.injection.latency import (
    DecodeMode,
    disable_compiled_decode,
    enable_compiled_decode,
    resolve_decode_mode,
)
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
from hf_dsinfer.integration import continuous_batching
from hf_dsinfer.kernels._dispatch import resolve
from hf_dsinfer.kernels.quant import probe_private_ops

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
    decode: DecodeMode | None = None
    tp: Any = None  # hf_dsinfer.parallel.tensor.TPReport when tp_size > 1
    moe: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> FusedMoE
    moe_quant: tuple[int, int] | None = None  # expert weight bytes (before, after) quantization
    ep: Any = None  # hf_dsinfer.parallel.expert.EPReport when ep_size > 1
    pp: Any = None  # hf_dsinfer.parallel.pipeline.PPReport when pp_size > 1
    head: HeadReport | None = None  # the output projection on the kernel library, if it is
    step: Any = None  # decode_step.NativeDecodeStep, when installed
    serving: Any = None  # integration.continuous_batching.ContinuousBatching, when installed


def get_report(model: nn.Module) -> InjectionReport | None:
    return getattr(model, REPORT_ATTR, None)


def inject(model: nn.Module, config: DSInferConfig) -> InjectionReport:
    """Fuse every supported decoder block of `model` in place and run the parity gate. On any
    error the model is left as it was (what was installed comes off) and the error is raised."""
    if get_report(model) is not None:
        revert(model)
    policy = find_policy(model)
    report = InjectionReport(config=config, model_class=type(model).__name__, policy=policy)
    setattr(model, REPORT_ATTR, report)
    try:
        _inject(model, config, report)
    except BaseException as err:
        _undo(model, report, err)
        raise
    return report


def _inject(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    policy = report.policy
    if policy is None or _layers_path(model, policy) is None:
        _handle_unsupported(model, config, report)
        _attach_offload(model, config)
        return
    backend = _model_backend(model, config)
    for path, index, block in _blocks(model, policy):
        if type(block).__name__ not in policy.block_classes:
            report.skipped[path] = getattr(block, "skip_reason", None) or \
                f"{type(block).__name__} is not a {policy.family} block class"
            continue
        if config.offload is None and _offloaded_by_accelerate(block):
            report.skipped[path] = ACCELERATE_OFFLOADED
            continue
        spec = resolve_spec(block, policy, model.config, index)
        report.blocks[path] = FusedBlock(block, policy, spec, backend)
    _warn_accelerate_offloaded(report)
    report.moe = build_moe(report.blocks, model.config, config.moe_capacity_factor)
    _check_quant(model, config, report)  # fail before touching the model
    _check_tp(model, config, policy)
    _check_moe(config, report)
    for fused in report.blocks.values():
        _install(fused.block, fused)
    install_moe(report.moe)
    _attach_offload(model, config)  # before the parity probe: it streams the weights in
    if config.parity_check and report.blocks and not _sharded_at_load(model):
        _apply_parity(model, report)
    if config.pp_size > 1:  # before tensor parallelism: its parity probe runs the pipeline
        from hf_dsinfer.parallel.pipeline import pipeline_parallelize

        report.pp = pipeline_parallelize(model, report)
    if config.tp_size > 1:
        from hf_dsinfer.parallel.tensor import parallelize

        report.tp = parallelize(model, report)
    if config.ep_size > 1:
        from hf_dsinfer.parallel.expert import parallelize_experts

        report.ep = parallelize_experts(model, report)
    if config.quant is not None:
        live = [f for f in report.blocks.values() if f.enabled]
        report.quant = quantize_blocks(live, config.quant)
        live_moe = {p: m for p, m in report.moe.items() if m.enabled}
        report.moe_quant = quantize_moe(live_moe, config.quant) if live_moe else None
        param = next(model.parameters())
        if param.device.type == "cpu":
            probe_private_ops(config.quant.bits, param.dtype)
    if report.blocks:
        report.head = install_head(model, config, backend)
    single = config.tp_size == config.ep_size == config.pp_size == 1
    if report.blocks and single and config.offload is None:
        report.step = install_decode_step(model, report.blocks, _layers_path(model, policy))
    if report.blocks and config.pp_size == 1:
        report.serving = continuous_batching.install(model, list(report.blocks.values()))
    report.decode = resolve_decode_mode(config, next(model.parameters()).device)
    if report.decode.compile or report.decode.cache == "static":
        enable_compiled_decode(model, report.decode)


def _undo(model: nn.Module, report: InjectionReport, err: BaseException) -> None:
    """After a failed inject: take off what it installed (`revert`). Sharded or quantized
    weights cannot be restored; the error then says so."""
    if get_report(model) is not report:  # the parity gate reverted already
        return
    try:
        revert(model)
    except DSInferError as undo_err:
        delattr(model, REPORT_ATTR)
        err.add_note(f"hf_dsinfer could not restore the model after this error ({undo_err}). "
                     "Load it again before using it.")


def revert(model: nn.Module) -> nn.Module:
    """Undo `inject`: every block gets its HF forward back (quantized linears stay quantized:
    dequantizing is lossy, and they remain ordinary callable modules). Returns the model."""
    report = get_report(model)
    if report is None:
        return model
    if report.tp is not None or report.pp is not None:
        from hf_dsinfer.parallel.groups import TensorParallelError

        raise TensorParallelError(
            "cannot revert or re-inject a tensor- or pipeline-parallel model: its weights are "
            "sharded across ranks and the HF forwards cannot run on them. Fix: load the model "
            "again.")
    uninstall_moe(report.moe)  # raises first if the experts are quantized or sharded
    _detach_offload(model)
    uninstall_head(model, report.head)
    uninstall_decode_step(report.step)
    continuous_batching.uninstall(report.serving)
    for fused in report.blocks.values():
        _uninstall(fused.block, fused)
    disable_compiled_decode(model)
    delattr(model, REPORT_ATTR)
    return model


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


def _attach_offload(model: nn.Module, config: DSInferConfig) -> None:
    if config.offload is not None:  # imported lazily: accelerate hooks, threads, safetensors
        from hf_dsinfer.offload.attach import attach_offload

        attach_offload(model, config.offload)


def _detach_offload(model: nn.Module) -> None:
    if getattr(model, "_dsinfer_offload", None) is not None:
        from hf_dsinfer.offload.attach import detach_offload

        detach_offload(model)


def _handle_unsupported(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    model_type = getattr(model.config, "model_type", "?")
    if report.policy is None:
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
    delattr(model, REPORT_ATTR)
    raise UnsupportedModelError(message)


def _sharded_at_load(model: nn.Module) -> bool:
    """Loaded with only this rank's slices (hf_dsinfer.parallel): no HF forward to compare."""
    return hasattr(model, "_dsinfer_tp_plan")


def _check_tp(model: nn.Module, config: DSInferConfig, policy: Policy) -> None:
    if config.tp_size > 1:
        from hf_dsinfer.parallel.tensor import check_tensor_parallel

        check_tensor_parallel(model, policy, config.tp_size)


def _check_moe(config: DSInferConfig, report: InjectionReport) -> None:
    if config.quant is not None:
        moe_group_size(report.moe, config.quant)
    if config.ep_size > 1:
        from hf_dsinfer.parallel.expert import check_expert_parallel

        check_expert_parallel(report, config)


def _check_quant(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    if config.quant is None:
        return
    param = next(model.parameters())
    check_quant_supported(config.quant, param.device, param.dtype)
    block_group_size(list(report.blocks.values()), config.quant)


def _model_backend(model: nn.Module, config: DSInferConfig) -> str:
    param = next(model.parameters())
    return resolve(config.kernels, param.device) if config.kernels == "auto" else config.kernels


def _layers_path(model: nn.Module, policy: Policy) -> str | None:
    """The block list's path in `model` (None: not found). `policy.layers` names it from the
    *ForCausalLM; other heads hold the same base model under their `base_model_prefix`
    (Llama's question-answering head: `transformer`), and a bare base model holds it itself."""
    tail = policy.layers.split(".", 1)[1]
    prefix = getattr(model, "base_model_prefix", None)
    candidates = (policy.layers, f"{prefix}.{tail}" if prefix else None, tail)
    return next((path for path in candidates if path and _has_path(model, path)), None)


def _blocks(model: nn.Module, policy: Policy):
    path = _layers_path(model, policy)
    container = () if path is None else model.get_submodule(path)
    for index, block in enumerate(container):
        yield f"{path}.{index}", index, block


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


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
    cfg = report.config
    if cfg.strict or cfg.tp_size > 1 or cfg.ep_size > 1:  # no HF fallback on sharded weights
        revert(model)
        raise ParityError(
            f"fused blocks disagree with their Hugging Face originals beyond tolerance: {detail}. "
            "The model was left unmodified. Fix: report this with the model config; pass "
            "strict=None to keep the HF blocks for the failing classes and fuse the rest."
        )
    for fused in report.blocks.values():
        if type(fused.block).__name__ in failed:
            fused.enabled = False
    warnings.warn(f"hf_dsinfer: parity gate failed, keeping HF forward for {detail}", stacklevel=4)
