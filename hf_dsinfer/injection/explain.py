"""`explain(model)`: a readable table of what injection replaced, with what, and what it left
alone and why."""

from __future__ import annotations

import functools
from itertools import groupby

import torch
from torch import nn

from hf_dsinfer import settings, state
from hf_dsinfer.injection.paths import PathRecord
from hf_dsinfer.injection.walker import InjectionReport, get_report

_LEFT_ALONE = {  # class-name suffix -> why a module outside the decoder blocks stays HF's
    "RotaryEmbedding": "cos/sin for all rope types, computed once per forward and fed to the "
                       "fused blocks",
    "Embedding": "embedding lookup: a gather, nothing to fuse",
    "Linear": "single GEMM outside the decoder blocks (lm_head / projection): already one op",
    "LayerNorm": "final norm: one op outside the decoder blocks",
    "RMSNorm": "final norm: one op outside the decoder blocks",
}


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _block_rows(report: InjectionReport) -> list[str]:
    rows = []
    items = list(report.blocks.items())
    for cls_name, group in groupby(items, key=lambda kv: type(kv[1].block).__name__):
        group = list(group)
        first, last = group[0][0], group[-1][0]
        span = first if len(group) == 1 else f"{first} .. {last.rsplit('.', 1)[-1]}"
        fused = group[0][1]
        enabled = sum(f.enabled for _, f in group)
        parity = report.parity.get(cls_name)
        if parity is None:
            status = "fused (parity check off)"
        elif enabled:
            status = f"fused; parity {parity.summary()}"
        else:
            status = f"kept HF forward; parity {parity.summary()}"
        calls = sum(f.calls for _, f in group)
        taken = functools.reduce(PathRecord.merge, (f.paths for _, f in group), PathRecord())
        rows.append(_row(span, f"{cls_name} x{len(group)}",
                         f"FusedBlock ({fused.spec.describe()})", status, calls,
                         taken.describe()))
    return rows


def _left_alone_rows(model: nn.Module, report: InjectionReport) -> list[str]:
    rows = [_row(path, "-", "-", f"left alone: {why}", "-", "-")
            for path, why in report.skipped.items()]
    block_prefix = next(iter(report.blocks), "").rsplit(".", 1)[0]
    for name, module in model.named_modules():
        if not name or (block_prefix and name.startswith(block_prefix)):
            continue
        why = next((w for suffix, w in _LEFT_ALONE.items()
                    if type(module).__name__.endswith(suffix)), None)
        if why and name.count(".") <= 2:
            rows.append(_row(name, type(module).__name__, "-", f"left alone: {why}", "-", "-"))
    return rows


def explain(model: nn.Module) -> str:
    """What hf_dsinfer did to `model`, as a Markdown table."""
    report = get_report(model)
    if report is None:
        return f"hf_dsinfer: {type(model).__name__} is not injected (call init_inference)."
    with settings.use(**(report.config.settings or {})):  # what this model's calls see
        return _explain(model, report)


def _explain(model: nn.Module, report: InjectionReport) -> str:
    cfg = report.config
    head = (f"hf_dsinfer: {report.model_class}"
            f" | family {report.policy.family if report.policy else '-'}"
            f" | kernels {cfg.kernels}"
            f"{' -> ' + next(iter(report.blocks.values())).backend if report.blocks else ''}"
            f" | dtype {next(model.parameters()).dtype}")
    if report.unmodified_reason:
        return f"{head}\nunmodified: {report.unmodified_reason}"
    extras = []
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu:
        extras += _cpu_lines()
    if report.quant is not None:
        extras.append(f"quantized: {report.quant.describe()}")
        if report.quant.bits == 8 and on_cpu:
            extras.append(f"int8 CPU kernel: {_int8_cpu_kernel(next(model.parameters()).dtype)}")
        if report.quant.bits == 4 and on_cpu and report.quant.act_bits == 8:
            extras.append(f"int4 CPU kernels: {_int4_a8_cpu_kernel()}")
        elif report.quant.bits == 4 and on_cpu:
            extras.append("int4 CPU kernels: "
                          f"{_int4_cpu_kernels(next(model.parameters()).dtype)}")
    if report.head is not None:
        extras.append(report.head.describe())
    if report.decode is not None:
        extras.append(f"decode (generate): {report.decode.describe()}")
    if report.settings is not None:
        extras.append(report.settings.describe())
    native = _native_decode_line(report, model)
    if native:
        extras.append(native)
    serving = _continuous_batching_line(report)
    if serving:
        extras.append(serving)
    batched = _batched_linear_line(report, model)
    if batched:
        extras.append(batched)
    if (engine := state.get(model, "engine")) is not None:
        extras.append(engine.describe())
    if report.tp is not None:
        extras.append(report.tp.describe())
    if getattr(report, "pp", None) is not None:
        extras.append(report.pp.describe())
    if report.moe_quant is not None:
        before, after = report.moe_quant
        extras.append(f"experts quantized: int{cfg.quant.bits} per expert, "
                      f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    if report.ep is not None:
        extras.append(report.ep.describe())
    head = "\n".join([head, *extras])
    lines = [head, "", _row("module", "HF class", "replaced by", "status", "fused calls",
                            "paths taken (calls)"),
             _row("---", "---", "---", "---", "---", "---")]
    return "\n".join(lines + _block_rows(report) + _moe_rows(report)
                     + _left_alone_rows(model, report))


def _native_decode_line(report: InjectionReport, model: nn.Module) -> str | None:
    """Which blocks compute one-token bf16 CPU steps in the native decode layer, or why not."""
    fused = [f for f in report.blocks.values() if hasattr(f, "decode_why")]
    if not fused or next(model.parameters()).device.type != "cpu":
        return None
    for f in fused:
        f.decode_layer()  # built on first use: build now, so its verdict is known
    whys = [f.decode_why for f in fused]
    native = sum(w is None for w in whys)
    if native == len(fused):
        line = ("batch-1 decode steps (bf16, CPU): native layer, kernels/csrc/cpu_decode.c, "
                f"in all {native} blocks")
        step = report.step
        if step is not None and step.reason() is None:
            whole = ("one native call per step with a DynamicCache" if step.chainable
                     else "its layers called one by one (sliding layers: one native call over "
                          "every layer needs full-attention cache layers)")
            line += f"; one loop over them per step ({type(step.inner).__name__}.forward), {whole}"
        else:
            why = "not installed" if step is None else step.reason()
            line += f"; each called by HF's layer loop ({why})"
        rows_whys = sorted({f._decode.rows_why for f in fused if f._decode.rows_why is not None})
        if rows_whys:
            return line + f"\nbatched steps: torch ops ({'; '.join(rows_whys)})"
        layer = fused[0]._decode
        return line + (f"\nbatched steps (2-{layer.rows_max} sequences): native layer with "
                       f"{layer.rows_kernels} projections, in all blocks (continuous "
                       "batching's decode rows too)")
    reasons = sorted({w for w in whys if w is not None})
    return (f"batch-1 decode steps: native layer in {native} of {len(fused)} blocks; "
            f"torch ops otherwise ({'; '.join(reasons)})")


def _continuous_batching_line(report: InjectionReport) -> str | None:
    """How the blocks take transformers' continuous batching (injection.paged): statically,
    and the calls so far."""
    from hf_dsinfer.injection import paged

    fused = list(report.blocks.values())
    if report.serving is None or not fused:
        return None
    whys = [paged.layout_why(f) for f in fused]
    line = (f"continuous batching (generate_batch, init_continuous_batching): fused attention over "
            f"the paged KV cache in {sum(w is None for w in whys)} of {len(fused)} blocks")
    static = sorted({w for w in whys if w is not None})
    calls = sum(f.paged.calls for f in fused)
    deferred: dict[str, int] = {}
    for f in fused:
        for why, n in f.paged.deferred.items():
            deferred[why] = deferred.get(why, 0) + n
    line += f" ({'; '.join(static)})" if static else ""
    line += f"; {calls} fused calls so far"
    if calls:
        segmented = sum(f.paged.segmented for f in fused)
        in_place = sum(f.paged.in_place for f in fused)
        line += (f" ({segmented} attending per request over its own keys, {in_place} of them "
                 "reading the keys where the cache keeps them; the others over the whole packed "
                 "row with its mask)")
    if deferred:
        line += "; calls sent to the HF forward: " + "; ".join(
            f"{why} ({n})" for why, n in sorted(deferred.items()))
    if refused := sum(f.paged.refused for f in fused):
        line += (f"; {refused} calls refused: the model's forward does not pass the paged cache "
                 "to its blocks, so generate_batch raises for this model")
    return line


def _batched_linear_line(report: InjectionReport, model: nn.Module) -> str | None:
    """Which kernel the bf16 block linears of 2..CPU_AMX_MAX_ROWS rows run on CPU (batched
    decode, short prompts); None for other dtypes, devices and backends."""
    from hf_dsinfer.kernels import _native
    from hf_dsinfer.kernels.linear import CPU_AMX_MAX_ROWS

    blocks = list(report.blocks.values())
    param = next(model.parameters())
    if (not blocks or param.dtype != torch.bfloat16 or param.device.type != "cpu"
            or blocks[0].backend != "cpu"):
        return None
    what = f"bf16 linears of 2-{CPU_AMX_MAX_ROWS} rows (batched decode, short prompts):"
    if _native.amx_available():
        return (f"{what} native AMX kernel, kernels/csrc/cpu_moe.c (sizes multiples of 32; "
                "others F.linear)")
    why = _native.why_unavailable() or "the CPU or kernel grants no AMX tiles"
    return f"{what} F.linear (native AMX kernel unavailable: {why})"


def _cpu_lines() -> list[str]:
    """The ISA tier of the native kernels, and torch's private ops refused by their probes."""
    from hf_dsinfer.kernels import _native, linear, private_ops

    lines = [f"CPU ISA: {_native.describe_tier()}"]
    if linear.fp32_gemm_tier():
        lines.append(f"bf16 products of {linear.FP32_GEMM_MIN_ROWS} rows and more that no native "
                     "kernel takes (prefill): fp32 GEMMs on weight chunks converted to fp32, "
                     f"since the {_native.tier()} tier has no bf16 dot products "
                     "(kernels/linear.py: bf16_gemm_in_fp32)")
    refused = [v.reason for v in private_ops.verdicts().values() if not v.ok]
    if refused:
        lines.append(f"private torch ops refused (their reference paths run): {'; '.join(refused)}")
    return lines


def _int8_cpu_kernel(dtype: torch.dtype) -> str:
    from hf_dsinfer.kernels import _native, private_ops
    from hf_dsinfer.kernels.quant import INT8PACK_MM

    why = _native.why_unavailable()
    if why is None:
        return f"native (kernels/csrc/cpu_quant.c, {_native.tier()} tier)"
    verdict = private_ops.verdicts().get((INT8PACK_MM, dtype))
    if verdict is not None and not verdict.ok:
        return f"dequantize + GEMM (torch's {INT8PACK_MM} refused; native kernel unavailable: {why})"
    return f"torch's _weight_int8pack_mm (native kernel unavailable: {why})"


def _int4_a8_cpu_kernel() -> str:
    """Which kernel multiplies 8-bit activations with 4-bit weights here (every row count)."""
    from hf_dsinfer.kernels import _native

    if _native.lib("a8") is not None:
        from hf_dsinfer.kernels import crossovers

        few = crossovers.rows().a8_rows_max_rows
        return (f"8-bit activations, every row count the same numbers: 1-{few} rows "
                f"kernels/csrc/cpu_decode.c (hfd_int4_a8_rows), more kernels/csrc/cpu_qgemm.c "
                f"(hfd_int4_gemm_a8), {_native.tier()} tier; out features not a multiple of 16: "
                "the torch reference")
    return ("8-bit activations, every row count: the torch reference "
            f"(kernels/quant.py: linear_int4_a8_ref; {_native.why_unavailable('a8')})")


def _int4_cpu_kernels(dtype: torch.dtype) -> str:
    """Which kernel a 4-bit linear of how many rows runs at this tier (kernels/quant.py:
    linear_int4_cpu, bounds from kernels/crossovers.py)."""
    from hf_dsinfer.kernels import _native, crossovers

    bounds, tier = crossovers.rows(), _native.tier()
    parts, done = [], 0
    if _native.lib("int4") is not None and bounds.int4_native_max_rows:
        done = bounds.int4_native_max_rows
        parts.append(f"1-{done} rows native (kernels/csrc/cpu_decode.c, {tier} tier)")
    bf16 = dtype == torch.bfloat16
    if bf16 and bounds.amx_int4_max_rows and _native.amx_available():
        parts.append(f"{done + 1}-{bounds.amx_int4_max_rows} rows AMX tiles on panels "
                     "dequantized in cache (kernels/csrc/cpu_moe.c; out features a multiple "
                     "of 32)")
        done = bounds.amx_int4_max_rows
    elif bf16 and bounds.int4_gemm_max_rows and _native.lib("panel") is not None:
        parts.append(f"{done + 1}-{bounds.int4_gemm_max_rows} rows panels dequantized in cache "
                     "(kernels/csrc/cpu_qgemm.c)")
        done = bounds.int4_gemm_max_rows
    if bounds.int4_pack_max_rows > done:
        parts.append(f"up to {bounds.int4_pack_max_rows} rows torch's "
                     "_weight_int4pack_mm_for_cpu where its probe passed")
    parts.append("more rows dequantize + GEMM")
    return "; ".join(parts)


def _moe_rows(report: InjectionReport) -> list[str]:
    """One row per run of sparse-MoE modules (dense MLP layers in between break a run)."""
    rows = []
    for _, group in groupby(report.moe.items(), key=lambda kv: type(kv[1].module).__name__):
        group = list(group)
        first, moe = group[0]
        span = first if len(group) == 1 else f"{first} .. {len(group)} modules"
        status = ("kept HF forward (its block)" if not moe.enabled
                  else moe.deferred_why or "fused (follows its block)")
        rows.append(_row(span, f"{type(moe.module).__name__} x{len(group)}",
                         f"FusedMoE ({moe.spec.describe()})", status,
                         sum(m.calls for _, m in group), "-"))
    return rows
