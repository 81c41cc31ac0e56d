"""Measurements of the machine that speed claims are compared against (same run, same process)."""

from __future__ import annotations

import ctypes
import os
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


# libgomp's omp_pause_resource_all(kind): omp_pause_soft
_OMP_PAUSE_SOFT = 1


def release_openmp_threads() -> bool:
    """Free the calling thread's pool of OpenMP worker threads (libgomp's
    omp_pause_resource_all, OpenMP 5.0; a later parallel region of this thread makes a new one).
    True when freed; False where the process's OpenMP runtime is not an already loaded libgomp
    that offers it.

    Why: libgomp gives every thread that starts parallel work a pool of workers of its own, kept
    until that thread ends, and while the pools hold more threads than the process has CPUs its
    idle workers sleep instead of spinning, so every parallel region pays a wake-up. A thread
    that hands the computing to another one (transformers' continuous batching manager) and
    only waits should release its pool first: on 2 cores, a 64k torch.add in the manager's
    thread took 20 us beside the caller's idle pool and 3.8 us after its release; 30 SmolLM2
    layers of 16 decode rows in the native kernels 25 ms against 10.7 ms."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0
