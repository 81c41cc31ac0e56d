"""Choosing an implementation (a "backend") for each kernel op.

Every op file in this package exposes `<op>_ref` (plain torch, HF numerics), `<op>_triton`
(Triton launcher) and, where torch has a better CPU primitive, `<op>_cpu`. The public `<op>`
entry point calls `pick(...)` with the backend the caller asked for (a fused module passes the
one from its DSInferConfig) and gets back which of the three to run.

Backends:
    "auto"   Triton on CUDA tensors when Triton is installed (kernels.linear excepted: cuBLAS,
             docs/gpu.md), the CPU fast path on CPU tensors,
             the reference otherwise.
    "ref"    always the plain torch reference.
    "triton" the Triton kernel; on CPU tensors only under TRITON_INTERPRET=1 (tests).
    "cpu"    the CPU fast path where one exists, else the reference.

hf_dsinfer.settings' `kernels` (default: the environment variable HF_DSINFER_KERNELS) is what a
call that passes no backend, or a model configured with kernels="auto", gets. The choice is a
pure function of its arguments and those settings.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from hf_dsinfer import settings

BACKENDS = settings.BACKENDS
ENV_VAR = settings.ENV["kernels"]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the `triton` package can be imported (it is imported lazily, never here)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (blocked)
        return False


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(name: str) -> str:
    """Validate a backend name; raise ValueError with the valid names otherwise."""
    if name not in BACKENDS:
        raise ValueError(
            f"kernels backend: expected one of {BACKENDS}, got {name!r}. "
            f"Fix: pass backend='auto' (or set {ENV_VAR}=auto)."
        )
    return name


def resolve(backend: str | None, device: torch.device, has_cpu_path: bool = True) -> str:
    """Return the concrete backend ("ref", "triton" or "cpu") for a tensor on `device`.

    Under torch.compile a call that would run Triton gets the reference: inductor fuses the
    reference's ops and writes its own Triton kernels for them, in one graph a CUDA graph can
    capture, where tracing into our launchers (the lazily built kernels, Triton's environment
    reads, importlib's find_spec in triton_available) broke the graph at every op. On the first
    real GPU run (an H200, 2026-11-27) those breaks made each decoder layer's cache update a
    frame of its own that recompiled per layer index until Dynamo's recompile limit, and a
    quantized model's compiled decode failed inside Dynamo. (CPU entry points make the same
    choice inside their own functions.)"""
    requested = check_backend(backend or settings.current().kernels)
    if torch.compiler.is_compiling() and (
            requested == "triton" or (requested == "auto" and device.type == "cuda")):
        return "ref"
    if requested == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        if device.type == "cpu" and has_cpu_path:
            return "cpu"
        return "ref"
    if requested == "triton":
        if not triton_available():
            raise RuntimeError(
                "kernels backend 'triton' was requested but triton is not installed. "
                "Fix: `pip install triton`, or use backend='auto'."
            )
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"kernels backend 'triton' needs CUDA tensors, got tensors on {device}. "
                "Fix: use backend='auto', or set TRITON_INTERPRET=1 to run Triton on the CPU "
                "(slow; meant for tests)."
            )
        return "triton"
    if requested == "cpu" and not has_cpu_path:
        return "ref"
    return requested


def triton_named(backend: str | None) -> bool:
    """True when the call (or, without one, the settings) asks for "triton" by name rather than
    "auto": some ops run cuBLAS on CUDA under "auto" (kernels.linear, many-row quantized
    linears: docs/gpu.md) and their Triton kernels only when named."""
    return (backend or settings.current().kernels) == "triton"


def pick(backend: str | None, device: torch.device, ref, triton_fn=None, cpu_fn=None):
    """Return the function to run for `backend` on `device` among ref / triton / cpu."""
    choice = resolve(backend, device, has_cpu_path=cpu_fn is not None)
    if choice == "triton":
        if triton_fn is None:
            return ref
        return triton_fn
    if choice == "cpu":
        return cpu_fn
    return ref
