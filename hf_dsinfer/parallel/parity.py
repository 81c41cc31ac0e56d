"""The parity gate for a model loaded sharded: tensor-parallel fused blocks vs HF, per class.

With sharded loading no rank ever holds the full model, and HF's own block forward cannot run on
sharded weights. So the loader gives the gate an unsharded copy of the first block of each class,
the reference, whose weights stay on meta: each submodule reads its *full* weights from the
checkpoint just before it runs and drops them right after, so the reference never holds more
than one weight matrix (holding a whole block put the rank's peak at 0.64x the single process,
against 0.59x without the gate). The gate runs the tensor-parallel model on the same probe as the single-process
gate (a left-padded prefill, then one cached decode step), records each reference block's
inputs and outputs as the model calls its sharded twin, replays those inputs through the HF
forward of the reference (with its own cache) and compares outputs at the non-padded positions.
The probe is identical on every rank and so are the all-reduced block outputs, so every rank
reaches the same verdict (no rank raises alone and leaves the others waiting).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from hf_dsinfer.injection.parity import (
    PARITY_TOLERANCE,
    ParityResult,
    _probe_inputs,
    prefill_and_step,
)
from hf_dsinfer.injection.policy import Policy

REFERENCES_ATTR = "_dsinfer_tp_references"  # class name -> (block path, unsharded HF block)


def build_references(model: nn.Module, policy: Policy, read_full: Any,
                     blocks: list[tuple[str, nn.Module]]) -> dict[str, tuple[str, nn.Module]]:
    """Unsharded copies of the first block of each class; `read_full(name)` gives a full tensor.

    `model` may still be on meta (full shapes). A copy's own parameters are read now; those of
    its submodules are read when the submodule is called and released when it returns."""
    refs: dict[str, tuple[str, nn.Module]] = {}
    for path, block in blocks:
        name = type(block).__name__
        if name in refs or name not in policy.block_classes:
            continue
        ref = copy.deepcopy(block)  # buffers (e.g. GPT-J's sin/cos table) are real
        _materialize(ref, path, read_full)  # the block's own parameters, if any
        for sub_name, sub in ref.named_modules():
            if sub is not ref and any(True for _ in sub.parameters(recurse=False)):
                _load_on_call(sub, f"{path}.{sub_name}", read_full)
        refs[name] = (path, ref.eval())
    return refs


def _materialize(module: nn.Module, prefix: str, read_full: Any) -> None:
    for attr, param in list(module.named_parameters(recurse=False)):
        tensor = read_full(f"{prefix}.{attr}").to(param.dtype)
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _release(module: nn.Module) -> None:
    for attr, param in list(module.named_parameters(recurse=False)):
        module._parameters[attr] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                requires_grad=False)


def _load_on_call(module: nn.Module, prefix: str, read_full: Any) -> None:
    """Full weights of `module` only while it runs: read before its forward, freed after."""
    _release(module)
    module.register_forward_pre_hook(lambda m, _args: _materialize(m, prefix, read_full))
    module.register_forward_hook(lambda m, _args, _out: _release(m))


def _capture(block: nn.Module, store: list) -> Any:
    def record(_module, args, kwargs, output):
        out = output[0] if isinstance(output, tuple) else output
        store.append((args, dict(kwargs), out.detach().float().clone()))
    return block.register_forward_hook(record, with_kwargs=True)


def _replay(ref: nn.Module, cache_arg: str, calls: list, config: Any) -> torch.Tensor:
    """The reference's outputs for the recorded calls, with a cache of its own."""
    cache = DynamicCache(config=config)
    signature = inspect.signature(type(ref).forward)
    outs = []
    for args, kwargs, _ in calls:
        bound = signature.bind(ref, *args, **kwargs)
        if cache_arg in bound.arguments:
            bound.arguments[cache_arg] = cache
        out = type(ref).forward(*bound.args, **bound.kwargs)
        outs.append((out[0] if isinstance(out, tuple) else out).float())
    return torch.cat(outs, dim=1)


@torch.no_grad()
def tp_parity_gate(model: nn.Module, report: Any,
                   refs: dict[str, tuple[str, nn.Module]]) -> dict[str, ParityResult]:
    ids, mask = _probe_inputs(model)
    calls = {path: [] for path, _ in refs.values()}
    handles = [_capture(report.blocks[path].block, calls[path]) for path in calls]
    counts = {path: f.calls for path, f in report.blocks.items()}
    try:
        prefill_and_step(model, ids, mask)
    finally:
        for handle in handles:
            handle.remove()
        for path, count in counts.items():
            report.blocks[path].calls = count  # the probe does not count as use
    valid = mask.bool()
    tolerance = PARITY_TOLERANCE.get(next(model.parameters()).dtype, 3e-2)
    results = {}
    for name, (path, ref) in refs.items():
        want = _replay(ref, report.policy.cache_arg, calls[path], model.config)[valid]
        got = torch.cat([out for _, _, out in calls[path]], dim=1)[valid]
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        results[name] = ParityResult(name, err, tolerance, 1)
    return results
