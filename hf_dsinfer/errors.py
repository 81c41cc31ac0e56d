"""Errors raised by hf_dsinfer.

Injection errors derive from `DSInferError`, which is deliberately *not* a ValueError,
TypeError, RuntimeError or OSError: transformers' `pipeline()` catches those four around
`from_pretrained` and retries in float32 or re-raises a generic "Could not load model" error,
which would hide what went wrong. Configuration errors are ValueErrors, as users expect from a
validated dataclass.
"""

from __future__ import annotations


class DSInferError(Exception):
    """Base class of hf_dsinfer's injection errors."""


class UnsupportedModelError(DSInferError):
    """The model's architecture has no injection policy (and strict injection was asked for)."""


class ParityError(DSInferError):
    """A fused block disagreed with its Hugging Face original beyond tolerance (strict=True)."""


class DSInferConfigError(ValueError):
    """An invalid DSInferConfig: unknown key, wrong type or impossible value."""


class ContinuousBatchingError(DSInferError):
    """A request under transformers' continuous batching failed or ended short, or a model's
    forward cannot take continuous batching's packed rows and paged cache."""


class PipelineParallelError(DSInferError):
    """Pipeline parallelism cannot be set up as asked, or a pipeline stage failed or timed out
    while the others were waiting for it (raised on every rank, never a hang)."""
