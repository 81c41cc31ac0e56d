"""Whole-decode-step capture through HF generate(): a preallocated static KV cache and a
torch.compile'd forward for every decode step (prefill stays eager: its shape changes per call).

transformers already owns this mechanism (`generation_config.cache_implementation="static"` +
`compile_config`), including the graph being reused across steps and across calls with the same
maximum length; it only enables it on CUDA unless the CompileConfig is flagged for all devices.
We set those fields on the model's own generation_config (instance state, reversible).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import CompileConfig

_SAVED_ATTR = "_dsinfer_saved_generation_fields"


def compile_config() -> CompileConfig:
    # dynamic=False: one graph per (batch, max length); "default" mode: CUDA graphs
    # ("reduce-overhead") are a CUDA notion and inductor falls back to it on CPU anyway.
    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # transformers' own switch for compiling off-CUDA
    return config


def enable_compiled_decode(model: nn.Module) -> None:
    gen = model.generation_config
    saved: dict[str, Any] = {"cache_implementation": gen.cache_implementation,
                             "compile_config": gen.compile_config}
    setattr(model, _SAVED_ATTR, saved)
    gen.cache_implementation = "static"
    gen.compile_config = compile_config()


def disable_compiled_decode(model: nn.Module) -> None:
    saved = getattr(model, _SAVED_ATTR, None)
    if saved is None:
        return
    for name, value in saved.items():
        setattr(model.generation_config, name, value)
    delattr(model, _SAVED_ATTR)
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
