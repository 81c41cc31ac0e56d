"""Which keyword carries the KV cache through transformers' forwards.

transformers 5.24 renamed `past_key_values` to `cache`: in the model and decoder-layer forwards,
in `generate`'s model kwargs, in the mask functions and in the output classes (whose
`past_key_values` stays readable). The old keyword is accepted with a FutureWarning until 5.40.
Releases before 5.24 pass a dense cache as `past_key_values` and continuous batching's
PagedAttentionCache as `cache`; from 5.24 both arrive as `cache`, and a few models pass it on to
their layers under a name of their own (BLOOM and GPT-NeoX: `layer_past`).

So a fused block finds its cache by type, not by keyword: the paged cache is the one that is a
PagedAttentionCache, the dense cache is any other cache under one of the names below. Calls
hf_dsinfer makes into transformers name the cache as the installed release does (`KEYWORD`).
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.models.llama.modeling_llama import LlamaModel

# the keyword of the installed release's model forwards
KEYWORD = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else (
    "past_key_values")
# the keywords a model forward takes its cache under (the old one deprecated from 5.24)
MODEL_NAMES = ("cache", "past_key_values")
# every keyword a decoder layer has received its cache under, in any 5.x release
NAMES = ("cache", "past_key_values", "layer_past", "past_key_value")


def paged_cache(named: dict[str, Any], arg: str = "cache") -> Any:
    """The PagedAttentionCache a continuous-batching call carries (`cache`, or the block's own
    keyword), or None."""
    for name in ("cache", arg):
        value = named.get(name)
        if isinstance(value, PagedAttentionCache):
            return value
    return None


def dense_cache(named: dict[str, Any], arg: str) -> Any:
    """The (non-paged) cache a block call carries under its policy's keyword `arg`, or under
    the name another release uses, or None."""
    value = named.get(arg)
    if value is None:
        value = next((named[n] for n in NAMES if named.get(n) is not None), None)
    return None if isinstance(value, PagedAttentionCache) else value


def with_cache(kwargs: dict[str, Any], cache: Any) -> dict[str, Any]:
    """`kwargs` with `cache` under the installed release's keyword (and the other one gone)."""
    out = {k: v for k, v in kwargs.items() if k not in MODEL_NAMES}
    out[KEYWORD] = cache
    return out


def model_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a model forward or `generate` was given, under either keyword."""
    value = kwargs.get("cache")
    return kwargs.get("past_key_values") if value is None else value


def parameter(function: Any, arg: str) -> str | None:
    """The parameter of a block forward that takes its cache: the policy's `arg` when the
    signature has it, else the first of NAMES it has (None: it takes none by name)."""
    params = inspect.signature(function).parameters
    return next((n for n in (arg, *NAMES) if n in params), None)
