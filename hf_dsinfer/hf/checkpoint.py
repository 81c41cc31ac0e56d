"""Checkpoint key names as transformers' own loader renames them (its internals live here only).

Sharded loading (tensor parallelism) reads tensors by name from a safetensors checkpoint whose keys
may be legacy names (GPT-NeoX's `embed_out`), or lack or carry an extra base-model prefix.
transformers 5 keeps the table of renamings and weight converters next to its loader, in
`conversion_mapping` / `core_model_loading`; this module is the one place that imports them.
"""

from __future__ import annotations

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
