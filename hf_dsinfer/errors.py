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


class ServeError(DSInferError):
    """A request `hf-dsinfer serve` refuses or cannot answer. Carries the HTTP status, the
    request field at fault (OpenAI's `param`) and a short code; the message says what was
    expected, what was given and the fix."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
