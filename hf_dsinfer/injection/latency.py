"""Whole-decode-step capture through HF generate(): a preallocated static KV cache and a
torch.compile'd forward for every decode step (prefill stays eager: its shape changes per call).

transformers already owns this mechanism (`generation_config.cache_implementation="static"` +
`compile_config`), including the graph being reused across steps and across calls with the same
maximum length; it only enables it on CUDA unless the CompileConfig is flagged for all devices.
We set those fields on the model's own generation_config (instance state, reversible).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers import CompileConfig

from hf_dsinfer import state


@dataclasses.dataclass(frozen=True)
class DecodeMode:
    """What `generate()` will use, resolved from DSInferConfig.compile / .cache and the device."""

    compile: bool
    cache: str  # "static" or "dynamic"
    reason: str

    def describe(self) -> str:
        step = "torch.compile'd decode step" if self.compile else "eager decode step"
        return f"{self.cache} KV cache, {step} ({self.reason})"


def resolve_decode_mode(config: Any, device: torch.device) -> DecodeMode:
    """compile None = auto: off, on every device. On CPU the gain measured by `hf-dsinfer
    bench` is small for a first call of tens of seconds (docs/performance.md, "Behind the
    code"). On CUDA it was on until the first GPU run (an H200, torch 2.11, 2026-11-27,
    docs/gpu.md): Llama-1.1B's compiled decode step ran at 0.14x HF eager, where the eager
    fused step had run at 0.96x (two runs, HF measured in each). Its graph broke there: in our dispatcher (importlib's
    find_spec) and on a generator in the fused block, both fixed since, and in transformers'
    output capturing (a ContextVar read torch 2.11's Dynamo cannot trace), after which every
    layer's frame recompiled. Not measured since the fixes; compile=True still asks for it.
    Never with tensor/expert parallelism or offload, whose collectives / block schedule run
    eagerly."""
    distributed = config.tp_size > 1 or config.ep_size > 1 or config.offload is not None
    if config.compile is not None:
        compile_, reason = config.compile, f"compile={config.compile}"
    elif distributed:
        compile_, reason = False, "auto: eager with tp/ep/offload"
    else:
        compile_, reason = False, f"auto on {device.type}: eager"
    cache = config.cache or ("static" if compile_ else "dynamic")
    return DecodeMode(compile_, cache, reason)


def compile_config(device: torch.device | None = None) -> CompileConfig:
    # dynamic=False: one graph per (batch, max length). On CUDA "reduce-overhead" replays the
    # step as a CUDA graph; on CPU inductor's default mode (CUDA graphs do not apply).
    cuda = device is not None and device.type == "cuda"
    config = CompileConfig(fullgraph=False, dynamic=False,
                           mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True  # transformers' own switch for compiling off-CUDA
    return config


def enable_compiled_decode(model: nn.Module, mode: DecodeMode | None = None) -> None:
    """Set the model's own generation_config to `mode` (default: static cache + compile)."""
    mode = mode or DecodeMode(True, "static", "compile=True")
    gen = model.generation_config
    saved: dict[str, Any] = {"cache_implementation": gen.cache_implementation,
                             "compile_config": gen.compile_config,
                             "disable_compile": getattr(gen, "disable_compile", False)}
    state.put(model, "saved_generation", saved)
    if mode.cache == "static":
        gen.cache_implementation = "static"
    if mode.compile:
        gen.compile_config = compile_config(next(model.parameters()).device)
    else:  # a static cache alone must not switch on HF's own auto-compile
        gen.disable_compile = True


def disable_compiled_decode(model: nn.Module) -> None:
    saved = state.get(model, "saved_generation")
    if saved is None:
        return
    for name, value in saved.items():
        setattr(model.generation_config, name, value)
    state.put(model, "saved_generation", None)
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
