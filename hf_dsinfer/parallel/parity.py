"""The references of the parity gate for a model loaded sharded (tensor parallelism).

With sharded loading no rank ever holds the full model, and HF's own block forward cannot run on
sharded weights. So the loader gives the gate (injection/parity.py, its `references` mode) an
unsharded copy of the first block of each class, the reference, whose weights stay on meta:
each submodule reads its *full* weights from the checkpoint just before it runs and drops them
right after, so the reference never holds more than one weight matrix (holding a whole block
put the rank's peak at 0.64x the single process, against 0.59x without the gate).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from hf_dsinfer.injection.policy import Policy


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
