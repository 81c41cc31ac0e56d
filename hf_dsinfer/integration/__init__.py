"""hf_dsinfer plugged into transformers' entry points: the `dsinfer=` keyword of
`from_pretrained` (shim.py) and the quantization method transformers loads through
(quantizer.py). The top of the layers (see docs/architecture.md); transformers' internals that
the lower layers need are read through `hf_dsinfer.hf`."""


def activate() -> None:
    """Register the quantization method and the `dsinfer=` keyword (idempotent)."""
    from hf_dsinfer.integration import quantizer, shim

    quantizer.register()
    shim.install()
