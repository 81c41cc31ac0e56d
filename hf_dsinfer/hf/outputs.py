"""What HF's output capture is collecting during the current forward.

transformers 5 records attention weights, router logits and hidden states with forward hooks on
the modules that produce them (`capture_outputs`, `OutputRecorder`), switched on per call by the
`output_*` keywords or the config's `output_*` fields. A fused path that bypasses such a module
must know whether its output is being collected, and then run the module (or HF's forward).
"""

from __future__ import annotations

from transformers.utils import output_capturing


def recording(key: str) -> bool:
    """Whether the running forward collects `key` ("attentions", "router_logits", ...)."""
    collected = output_capturing._active_collector.get()
    return collected is not None and key in collected


def capturing() -> bool:
    """Whether the running forward collects any output at all."""
    return output_capturing._active_collector.get() is not None


def is_capture_hook(hook: object) -> bool:
    """Whether `hook` is the forward hook transformers' output capture installs on the decoder
    layers (left in place after the first capturing call; inert while nothing is captured)."""
    return getattr(hook, "__qualname__", "").endswith(".output_capturing_hook")
