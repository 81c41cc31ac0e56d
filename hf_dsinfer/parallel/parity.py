"""The parity gate for a model loaded sharded: tensor-parallel fused blocks vs HF, per class.

With sharded loading no rank ever holds the full model, and HF's own block forward cannot run on
sharded weights. So, before the shards load, the loader reads the *full* weights of the first
block of each class (one block: a small fraction of the model) into an unsharded copy of it, the
reference. The gate then runs the tensor-parallel model on the same probe as the single-process
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
    """Unsharded copies of the first block of each class; `read_full(name)` gives a tensor.

    `model` is still on meta (full shapes); the copies get real, full weights."""
    refs: dict[str, tuple[str, nn.Module]] = {}
    for path, block in blocks:
        name = type(block).__name__
        if name in refs or name not in policy.block_classes:
            continue
        ref = copy.deepcopy(block)
        for pname, param in list(ref.named_parameters()):
            owner, _, attr = pname.rpartition(".")
            tensor = read_full(f"{path}.{pname}").to(param.dtype)
            ref.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        refs[name] = (path, ref.eval())
    return refs


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
