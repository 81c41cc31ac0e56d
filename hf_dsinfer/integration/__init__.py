"""The only place that talks to transformers/accelerate internals."""

from hf_dsinfer.integration import quantizer, shim


def activate() -> None:
    """Register the quantization method and the `dsinfer=` keyword (idempotent)."""
    quantizer.register()
    shim.install()
