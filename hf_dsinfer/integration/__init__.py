"""The only place that talks to transformers/accelerate internals.

The modules are imported where used (not here), so that injection code can read HF's output
capture (`outputs`) without importing the from_pretrained shim, which imports injection."""


def activate() -> None:
    """Register the quantization method and the `dsinfer=` keyword (idempotent)."""
    from hf_dsinfer.integration import quantizer, shim

    quantizer.register()
    shim.install()
