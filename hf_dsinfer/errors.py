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


class QuantizationError(DSInferError):
    """Weight-only quantization cannot be applied as configured (no int8 / int4 path for the
    device and dtype, or a group size that does not divide the layers)."""


class TensorParallelError(DSInferError):
    """Tensor parallelism cannot be set up as asked (no process group, sizes that don't fit)."""


class ExpertParallelError(DSInferError):
    """Expert parallelism cannot be set up as asked (sizes that do not fit, no MoE blocks)."""


class MoeStateError(DSInferError):
    """An HF forward was requested from a MoE block whose experts it can no longer compute."""


class OffloadFileError(DSInferError):
    """An offload file is missing, truncated, corrupted, or its folder cannot be written."""


class OffloadBudgetError(DSInferError):
    """The policy does not fit the memory budget it promises to keep."""


class PolicyError(DSInferError):
    """An injection policy (a family's data file) names an impossible combination of options.
    Raised when the policy is defined, so a typo fails at import, not at the first forward."""


class NativeUnsupported(Exception):
    """Why a layer (or one of its weights) is not computed by the native decode kernels. Not an
    error for the user: callers catch it and take the torch path, recording the reason."""


class NativeABIError(DSInferError):
    """A native kernel library reports another C interface (version or struct layout) than the
    Python side mirrors (kernels/abi.py): it is refused, and the kernels fall back to torch."""


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
class PipelineParallelError(DSInferError):
    """Pipeline parallelism cannot be set up as asked, or a pipeline stage failed or timed out
    while the others were waiting for it (raised on every rank, never a hang)."""


class StageExit(Exception):
    """Control flow of a pipeline stage (parallel/pipeline.py), not an error: raised by the exit
    placeholder when the stage's part of the forward is done, carrying its hidden state."""

    def __init__(self, hidden: object):
        super().__init__("pipeline stage exit")
        self.hidden = hidden
