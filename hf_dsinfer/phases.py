"""The injection pipeline: every phase of `init_inference`, in order, in one place.

    begin             the report, on the model                       injection.walker
    prepare           fused blocks built, quant / MoE checked         injection.walker
    check parallel    TP and EP sizes against the model               parallel.tensor / .expert
    install           fused blocks and MoE layers in place            injection.walker
    attach offload    weights streamed from the store                 offload.attach
    parity gate       fused vs HF on probe inputs                     injection.walker
    pipeline stages   this rank's stage of the layers                 parallel.pipeline
    shard             tensor-parallel and expert-parallel slices      parallel.tensor / .expert
                      (loaded sharded: the parity gate now, against unsharded references)
    quantize          int8 / int4 weights                             injection.walker
    finish            output head, decode step, serving, compile      injection.walker
    generate          the one model.generate (offload / pipeline schedule, TP / EP sync)

Any error after `begin` takes off whatever was installed (`revert`) before it propagates, so a
failed call leaves the model as it was. This module sits above injection, parallel and offload
(docs/architecture.md): they never import it, and it is the only one that calls into all three.
"""

from __future__ import annotations

import functools

from torch import nn

from hf_dsinfer import state
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import DSInferError, TensorParallelError
from hf_dsinfer.injection import walker
from hf_dsinfer.injection.walker import InjectionReport, get_report


def inject(model: nn.Module, config: DSInferConfig) -> InjectionReport:
    """Fuse every supported decoder block of `model` in place, with the parallel, offload and
    quantization phases the config asks for. On any error the model is left as it was (what
    was installed comes off) and the error is raised."""
    if get_report(model) is not None:
        revert(model)
    report = walker.begin(model, config)
    try:
        _run(model, config, report)
    except BaseException as err:
        _undo(model, report, err)
        raise
    return report


def _run(model: nn.Module, config: DSInferConfig, report: InjectionReport) -> None:
    if not walker.prepare(model, config, report):  # unsupported, running unmodified
        _attach_offload(model, config)
        _own_generate(model, report)
        return
    if config.tp_size > 1:
        from hf_dsinfer.parallel.tensor import check_tensor_parallel

        check_tensor_parallel(model, report.policy, config.tp_size)
    if config.ep_size > 1:
        from hf_dsinfer.parallel.expert import check_expert_parallel

        check_expert_parallel(report, config)
    walker.install(model, report)
    _attach_offload(model, config)  # before the parity probe: it streams the weights in
    walker.check_parity(model, report)
    if config.pp_size > 1:  # before tensor parallelism: its parity probe runs the pipeline
        from hf_dsinfer.parallel.pipeline import pipeline_parallelize
        report.pp = pipeline_parallelize(model, report)
    if config.tp_size > 1:
        from hf_dsinfer.parallel.tensor import parallelize

        report.tp = parallelize(model, report)
    if config.ep_size > 1:
        from hf_dsinfer.parallel.expert import parallelize_experts
        from hf_dsinfer.parallel.pipeline import held_bytes

        report.ep = parallelize_experts(model, report)
        if report.pp is not None:  # the stage's experts are sliced now
            report.pp.loaded_bytes = held_bytes(model)
    _gate_sharded(model, report)
    walker.quantize(model, config, report)
    walker.finish(model, config, report)
    _own_generate(model, report)


def _gate_sharded(model: nn.Module, report: InjectionReport) -> None:
    """Loaded sharded (each rank read only its slices / stage / experts): the parity gate
    against the loader's unsharded references, once every slice is in place; on a pipeline,
    every rank reaches one verdict."""
    references = state.pop(model, "references")
    if references is None:
        return
    if report.pp is not None:
        from hf_dsinfer.parallel.pipeline import stage_parity_gate

        stage_parity_gate(model, report, references)
    else:
        walker.check_parity(model, report, references)


def _own_generate(model: nn.Module, report: InjectionReport) -> None:
    """The one `model.generate` of an injected model: HF's own, or what a phase must run in
    its place (offload's block schedule, the pipelined schedule), wrapped by the parallel
    phases that need every rank in step (TP: one RNG state; EP: synced ranks). Installed here
    only, as an instance attribute; `revert` takes it off."""
    generate = None
    if state.get(model, "engine") is not None:
        from hf_dsinfer.offload.schedule import offload_generate

        generate = functools.partial(offload_generate, model)
    if report.pp is not None:
        from hf_dsinfer.parallel.pipeline_generate import PipelinedGenerate

        generate = PipelinedGenerate(model, report.pp.runner, report.config)
    if report.tp is not None:
        from hf_dsinfer.parallel.groups import tensor_parallel_group
        from hf_dsinfer.parallel.tensor import SyncedGenerate

        generate = SyncedGenerate(generate or model.generate,
                                  tensor_parallel_group(report.config.tp_size))
    if report.ep is not None and report.pp is None:  # a pipeline's stages step together
        from hf_dsinfer.parallel.expert import SyncedExpertGenerate

        generate = SyncedExpertGenerate(generate or model.generate)
    if generate is not None:
        model.generate = generate


def _undo(model: nn.Module, report: InjectionReport, err: BaseException) -> None:
    """After a failed inject: take off what it installed (`revert`). Sharded or quantized
    weights cannot be restored; the error then says so."""
    if get_report(model) is not report:  # an unsupported model under strict: nothing installed
        return
    try:
        revert(model)
    except DSInferError as undo_err:
        state.put(model, "report", None)
        err.add_note(f"hf_dsinfer could not restore the model after this error ({undo_err}). "
                     "Load it again before using it.")


def revert(model: nn.Module) -> nn.Module:
    """Undo `inject`: every block gets its HF forward back (quantized linears stay quantized:
    dequantizing is lossy, and they remain ordinary callable modules). Returns the model."""
    report = get_report(model)
    if report is None:
        return model
    if report.tp is not None or report.pp is not None:
        raise TensorParallelError(
            "cannot revert or re-inject a tensor- or pipeline-parallel model: its weights are "
            "sharded across ranks and the HF forwards cannot run on them. Fix: load the model "
            "again.")
    walker.release_moe(report)  # raises first if the experts are quantized or sharded
    _detach_offload(model)
    model.__dict__.pop("generate", None)  # _own_generate's, if it installed one
    walker.remove(model, report)
    return model


def _attach_offload(model: nn.Module, config: DSInferConfig) -> None:
    if config.offload is not None:  # imported lazily: accelerate hooks, threads, safetensors
        from hf_dsinfer.offload.attach import attach_offload

        attach_offload(model, config.offload)


def _detach_offload(model: nn.Module) -> None:
    if state.get(model, "engine") is not None:
        from hf_dsinfer.offload.attach import detach_offload

        detach_offload(model)
