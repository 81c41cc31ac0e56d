"""Checkpoint key names as transformers' own loader renames them (its internals live here only).

Sharded loading (tensor parallelism) reads tensors by name from a safetensors checkpoint whose keys
may be legacy names (GPT-NeoX's `embed_out`), or lack or carry an extra base-model prefix.
transformers 5 keeps the table of renamings and weight converters next to its loader, in
`conversion_mapping` / `core_model_loading`; this module is the one place that imports them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn


def renamed_keys(model: nn.Module, keys: Iterable[str]) -> Iterator[tuple[str, str, Any]]:
    """(checkpoint key, model tensor name, converter or None) for each checkpoint key. A key with a
    converter needs transformers' weight conversion (merging per-expert tensors, splitting fused
    ones) rather than a plain rename."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = dict.fromkeys(model.state_dict())
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters,
                                            model.base_model_prefix, meta)
        yield key, name, converter


def stacked_expert_sources(model: nn.Module, keys: Iterable[str]
                           ) -> tuple[dict[str, str], dict[str, list[list[str]]]] | None:
    """Checkpoint keys of a model whose per-expert MoE tensors transformers stacks while loading.

    Returns (model tensor name -> checkpoint key for plainly renamed tensors, model tensor name
    -> per source pattern, the checkpoint keys of experts 0..E-1), where the model tensor is
    those lists stacked per pattern along a new dim 0 and the patterns concatenated along dim 1
    (gate | up -> gate_up_proj [E, 2I, H]; down -> down_proj [E, H, I]): the one conversion
    transformers 5 applies to the MoE families' checkpoints. None when any converter does
    something else (that checkpoint is then loaded whole)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    converters = {pattern: t for t in get_model_conversion_mapping(model)
                  for pattern in getattr(t, "source_patterns", ())
                  if type(t).__name__ == "WeightConverter"}
    plain: dict[str, str] = {}
    found: dict[str, dict[int, dict[int, str]]] = {}  # name -> pattern index -> expert -> key
    for key, name, pattern in renamed_keys(model, keys):
        if pattern is None:
            plain[name] = key
            continue
        converter = converters.get(pattern)
        expert = _expert_index(pattern, key)
        if converter is None or expert is None or not _stacks_experts(converter):
            return None
        found.setdefault(name, {}).setdefault(converter.source_patterns.index(pattern),
                                              {})[expert] = key
    merged = {}
    for name, parts in found.items():
        lists = [[parts[p][e] for e in sorted(parts[p])] for p in sorted(parts)]
        if any(sorted(parts[p]) != list(range(len(parts[p]))) for p in parts) \
                or len({len(x) for x in lists}) != 1:
            return None  # experts missing from the checkpoint: let transformers report it
        merged[name] = lists
    return plain, merged


def _expert_index(pattern: str, key: str) -> int | None:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    return int(match.group(1)) if match else None


def _stacks_experts(converter: Any) -> bool:
    """MergeModulelist(dim=0), then Concatenate(dim=1) when it has two source patterns."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if len(converter.source_patterns) == 1:
        return ops == [("MergeModulelist", 0)]
    return ops == [("MergeModulelist", 0), ("Concatenate", 1)] \
        and len(converter.source_patterns) == 2
