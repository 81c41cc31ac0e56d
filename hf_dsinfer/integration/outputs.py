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
