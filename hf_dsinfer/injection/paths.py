"""Which path each call of a fused block actually took, recorded where the choice is made and
read by `explain` (so the report cannot drift from what ran).

A block's call ends in one of:
    hf           HF's forward (training, attentions asked for, cross-attention, a parity-gate
                 failure, a continuous-batching call the fused attention does not take): the
                 reason is recorded with it
    torch        the fused block on kernels' ops (torch / Triton / CPU fast paths)
    paged        the same over continuous batching's packed rows and paged KV cache
    paged_native continuous batching's decode-only forwards (one token per request) in the
                 native layer: one request the batch-1 one, several the batched one
    paged_native_mixed  continuous batching's forwards with prefill chunks in the native
                 batched layer (every packed token a row), torch attention per request
    native       one token of one sequence in the native layer (two C calls, HF's cache between)
    native_rows  one token of each of several sequences in the native batched layer
    native_in    native projections, then torch attention (a cache or mask the kernel can't read)
    step_loop    the model-level decode step's loop of native layer calls (decode_step.py)
    step_chain   the whole step as one native call over every layer (decode_step.py)
and, on top of native_in / torch, `cache_attend` counts attention over the offload cache's
stored 4-bit codes. Calls inside a torch.compile trace are not counted (a mutated Python
counter would force recompiles); `explain` says the compiled decode runs instead.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

PATHS = ("hf", "torch", "paged", "paged_native", "paged_native_mixed", "native", "native_rows",
         "native_in", "step_loop", "step_chain", "cache_attend")


@dataclasses.dataclass
class PathRecord:
    counts: Counter = dataclasses.field(default_factory=Counter)  # path -> calls
    hf_why: Counter = dataclasses.field(default_factory=Counter)  # reason -> calls sent to HF

    def took(self, path: str, why: str | None = None) -> None:
        if path not in PATHS:
            raise ValueError(f"path {path!r}: expected one of {PATHS}")
        self.counts[path] += 1
        if why is not None:
            self.hf_why[why] += 1

    def merge(self, other: PathRecord) -> PathRecord:
        return PathRecord(self.counts + other.counts, self.hf_why + other.hf_why)

    def describe(self) -> str:
        """'native 30, torch 2, hf 1 (output_attentions asked)', or 'no calls yet'."""
        if not self.counts:
            return "no calls yet"
        parts = [f"{p} {self.counts[p]}" for p in PATHS if self.counts[p] and p != "hf"]
        if self.counts["hf"]:
            why = "; ".join(f"{w}: {n}" for w, n in sorted(self.hf_why.items()))
            parts.append(f"hf {self.counts['hf']}" + (f" ({why})" if why else ""))
        return ", ".join(parts)
