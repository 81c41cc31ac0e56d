"""A discrete-event simulator of the pipelined generate schedule (pipeline_generate.py).

Inputs are per-stage compute times of one prompt micro-batch and of one generation
micro-batch step, the link time of a hidden state between neighbouring stages and of the
tokens from the last stage back to stage 0. Each stage is one server that handles its queue
in arrival order (as the ranks do: they receive from one neighbour, in order). Stage 0 starts
with every prompt micro-batch queued; when the last stage finishes the last prompt of a
generation micro-batch, or one of its decode steps, the tokens travel back to stage 0 and the
micro-batch's next step joins stage 0's queue - at once (dynamic queue) or, in the lock-step
baseline, when every micro-batch's tokens of that step have arrived (a barrier per token).

    result = simulate(Workload(stages=4, prompt_micro_batches=8, micro_batches=4, steps=31,
                               prompt_time=2e-3, decode_time=5e-4, link_time=1e-4))
    result.bubble_fraction, result.makespan, ideal_bubble(workload)

All micro-batches of a phase are taken as equal; rows finishing early are not modelled.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Workload:
    """One pipelined generate call. Times in seconds, per stage (a list) or the same for all.

    Attributes:
        stages: pipeline stages P.
        prompt_micro_batches: micro-batches of the prompt phase.
        micro_batches: micro-batches of the generation phase (each joins whole prompt ones).
        steps: decode steps after the prompt (new tokens per row - 1).
        prompt_time: compute time of one prompt micro-batch on each stage.
        decode_time: compute time of one generation micro-batch step on each stage.
        link_time: a hidden state from stage s to s + 1.
        token_time: the tokens from the last stage back to stage 0.
        lockstep: the baseline with a barrier across the batch at every token.
    """

    stages: int
    prompt_micro_batches: int
    micro_batches: int
    steps: int
    prompt_time: float | Sequence[float]
    decode_time: float | Sequence[float]
    link_time: float = 0.0
    token_time: float = 0.0
    lockstep: bool = False

    def __post_init__(self) -> None:
        if not (self.stages >= 1 and self.micro_batches >= 1 and self.steps >= 0
                and self.prompt_micro_batches >= self.micro_batches):
            raise ValueError(
                f"Workload: expected stages >= 1, micro_batches >= 1, steps >= 0 and "
                f"prompt_micro_batches >= micro_batches, got {self}.")

    def per_stage(self, value: float | Sequence[float]) -> list[float]:
        values = [float(value)] * self.stages if isinstance(value, (int, float)) else \
            [float(v) for v in value]
        if len(values) != self.stages:
            raise ValueError(f"Workload: {len(values)} stage times for {self.stages} stages.")
        return values


@dataclasses.dataclass(frozen=True)
class SimResult:
    makespan: float               # seconds from the first prompt to the last token
    busy: tuple[float, ...]       # compute seconds per stage

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time: 1 - sum(busy) / (P * makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def tokens_per_second(self, rows: int, steps: int) -> float:
        return rows * (steps + 1) / self.makespan


def _groups(prompts: int, micro_batches: int) -> list[int]:
    """Index of the last prompt micro-batch of each generation micro-batch (as
    torch.tensor_split cuts them in pipeline_generate)."""
    base, extra = divmod(prompts, micro_batches)
    ends, start = [], 0
    for g in range(micro_batches):
        start += base + (g < extra)
        ends.append(start - 1)
    return ends


def simulate(work: Workload) -> SimResult:
    """Event-driven run of the schedule; returns its makespan and per-stage busy time."""
    prompt, decode = work.per_stage(work.prompt_time), work.per_stage(work.decode_time)
    last = work.stages - 1
    group_end = {p: g for g, p in enumerate(_groups(work.prompt_micro_batches,
                                                     work.micro_batches))}
    free = [0.0] * work.stages
    busy = [0.0] * work.stages
    events: list = []  # (arrival time, sequence, stage, kind, micro-batch, step)
    order = 0

    def arrive(time: float, stage: int, kind: str, mb: int, step: int) -> None:
        nonlocal order
        heapq.heappush(events, (time, order, stage, kind, mb, step))
        order += 1

    for p in range(work.prompt_micro_batches):
        arrive(0.0, 0, "prompt", p, 0)
    barrier: dict[int, list[float]] = {}
    end = 0.0
    while events:
        time, _, stage, kind, mb, step = heapq.heappop(events)
        cost = (prompt if kind == "prompt" else decode)[stage]
        start = max(time, free[stage])
        free[stage] = start + cost
        busy[stage] += cost
        end = max(end, free[stage])
        if stage < last:
            arrive(free[stage] + work.link_time, stage + 1, kind, mb, step)
            continue
        g = group_end.get(mb) if kind == "prompt" else mb
        if g is None or step >= work.steps:  # a prompt part, or this micro-batch is done
            continue
        back = free[stage] + work.token_time
        if not work.lockstep:
            arrive(back, 0, "decode", g, step + 1)
            continue
        barrier.setdefault(step, []).append(back)
        if len(barrier[step]) == work.micro_batches:  # every micro-batch's token is back
            release = max(barrier.pop(step))
            for h in range(work.micro_batches):
                arrive(release, 0, "decode", h, step + 1)
    if work.stages == 1:  # a single stage: no pipeline to wait on, tokens return at once
        end = max(end, free[0])
    return SimResult(end, tuple(busy))


def ideal_bubble(work: Workload) -> float:
    """The schedule's ideal: each stage idles only while the first prompt reaches it (fill)
    and while its last item travels on through the later stages (drain), once per call;
    links are free and there are enough micro-batches in flight (micro_batches >= stages) to
    keep every stage fed between. With equal stage times t and N items per stage this is
    (P - 1) / (N + P - 1); the lock-step baseline pays fill and drain at every token."""
    prompt, decode = work.per_stage(work.prompt_time), work.per_stage(work.decode_time)
    items = work.steps * work.micro_batches
    busy = [work.prompt_micro_batches * p + items * d for p, d in zip(prompt, decode)]
    fill = [sum(prompt[:s]) for s in range(work.stages)]
    drain = [sum(decode[s + 1:]) if work.steps else sum(prompt[s + 1:])
             for s in range(work.stages)]
    if work.lockstep:  # every step refills and drains the pipeline
        drain = [d + work.steps * (sum(decode) - decode[s]) for s, d in enumerate(drain)]
    makespan = max(f + b + d for f, b, d in zip(fill, busy, drain))
    return 1.0 - sum(busy) / (work.stages * makespan)
