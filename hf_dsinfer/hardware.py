"""Measurements of the machine that speed claims are compared against (same run, same process)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[int], object], reps: int, device: str | torch.device = "cpu") -> float:
    """Median seconds of `fn(i)` over `reps` calls, after one warm-up call."""
    fn(0)
    times = []
    for i in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn(i)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(device: str | torch.device = "cpu", gib: float = 1.0) -> float:
    """GB/s of summing a tensor far larger than the L3 cache (a pure streaming read)."""
    x = torch.ones(int(gib * 2**30 // 4), dtype=torch.float32, device=device)
    seconds = median_time(lambda i: x.sum(), 5, device)
    return x.numel() * 4 / seconds / 1e9
