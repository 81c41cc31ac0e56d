"""The one way to find a model's decoder layers.

With a policy (a supported family): the list its `layers` path names from the *ForCausalLM, or
the same path under the model's `base_model_prefix` (other heads: Llama's question-answering
head keeps the base model under `transformer`), or the tail of the path (a bare base model).
Without one (offloading a family no policy names): the longest nn.ModuleList of the model's
`_no_split_modules` class, transformers' own name for a decoder layer.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from hf_dsinfer.errors import DSInferError
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.injection.policy import Policy


def layers_path(model: nn.Module, policy: Policy | None = None) -> str | None:
    """The path of the decoder-layer list in `model` (None: not found). `policy` defaults to
    the model's own (find_policy)."""
    policy = policy or find_policy(model)
    if policy is None:
        found = _no_split_list(model)
        return None if found is None else found[0]
    tail = policy.layers.split(".", 1)[1]
    prefix = getattr(model, "base_model_prefix", None)
    candidates = (policy.layers, f"{prefix}.{tail}" if prefix else None, tail)
    return next((path for path in candidates if path and _has_path(model, path)), None)


def decoder_layers(model: nn.Module, policy: Policy | None = None) -> tuple[str, nn.ModuleList]:
    """(path, the decoder-layer list), or DSInferError naming what was looked for."""
    path = layers_path(model, policy)
    if path is None:
        names = sorted(getattr(model, "_no_split_modules", None) or [])
        raise DSInferError(
            f"hf_dsinfer: cannot find the decoder layers of {type(model).__name__} (no policy "
            f"path, and no nn.ModuleList of its _no_split_modules {names}). Fix: hf_dsinfer "
            "supports transformers decoder-only models that declare _no_split_modules.")
    return path, model.get_submodule(path)


def iter_layers(model: nn.Module, policy: Policy | None = None
                ) -> Iterator[tuple[str, int, nn.Module]]:
    """(path, index, layer) of every decoder layer; nothing when they cannot be found."""
    path = layers_path(model, policy)
    container = () if path is None else model.get_submodule(path)
    for index, block in enumerate(container):
        yield f"{path}.{index}", index, block


def _no_split_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    names = set(getattr(model, "_no_split_modules", None) or [])
    best = None
    for path, module in model.named_modules():
        alike = isinstance(module, nn.ModuleList) and len(module) and all(
            type(m).__name__ in names for m in module)
        if alike and (best is None or len(module) > len(best[1])):
            best = (path, module)
    return best


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False
