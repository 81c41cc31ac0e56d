"""ZeRO-Inference's parallel fetch (DeepSpeed-Inference §VI) for the offload store.

With N processes that run the same generate calls on a model whose layers stream from disk,
each layer file is cut into N equal, page-aligned chunks: rank r reads only chunk r (one
buffered read) and one all-gather over the ranks fills the rest of the layer buffer, so every
rank holds the whole layer while the disk (or page cache) served each byte once per rank
group - the ranks' read bandwidths add up. Used by offload.store.WeightStore.load (on the
prefetch thread) when `OffloadPolicy(parallel_fetch=True)`; the collectives run on a process
group of their own, so they never interleave with other collectives of the model.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from hf_dsinfer.errors import DSInferError
from hf_dsinfer.offload.files import DIRECT_ALIGN, SafetensorsFile, aligned_size
from hf_dsinfer.parallel.groups import ensure_world


class ParallelFetch:
    """Reads this rank's 1/N of each layer file; an all-gather brings the other ranks' parts."""

    def __init__(self):
        world = ensure_world("offload parallel_fetch")
        if world < 2:
            raise DSInferError(
                "offload parallel_fetch=True needs torch.distributed with 2 or more processes, "
                "got a world of 1. Fix: launch with torchrun --nproc-per-node N, or drop "
                "parallel_fetch.")
        self.rank, self.size = dist.get_rank(), world
        self.group = dist.new_group(list(range(world)))  # the fetch's own collectives
        self.bytes_read = 0  # from this rank's files: about 1/N of every layer read
        self.bytes_gathered = 0  # received from the other ranks
        self._lock = threading.Lock()

    def chunk(self, size: int) -> int:
        return aligned_size(math.ceil(size / self.size))

    def span(self, size: int) -> int:
        """Bytes a layer buffer needs for a file of `size` bytes (N whole chunks)."""
        return self.chunk(size) * self.size

    def read_all(self, file: SafetensorsFile, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor of `file` as views of `out` (at least span(file.size) bytes)."""
        size, chunk = file.size, self.chunk(file.size)
        assert out.numel() >= chunk * self.size and chunk % DIRECT_ALIGN == 0
        start = self.rank * chunk
        stop = min(size, start + chunk)
        if stop > start:
            file.read_span(out[start:stop], start)
        parts = [out[i * chunk:(i + 1) * chunk] for i in range(self.size)]
        dist.all_gather(parts, parts[self.rank].clone(), group=self.group)
        with self._lock:
            self.bytes_read += max(0, stop - start)
            self.bytes_gathered += size - max(0, stop - start)
        return file.views(out)

    def build_in_turn(self, build) -> None:
        """Rank 0 writes the shared disk tier, then the others open (and verify) it."""
        if self.rank == 0:
            build()
        dist.barrier(group=self.group)
        if self.rank != 0:
            build()

    def describe(self) -> str:
        return (f"parallel fetch: rank {self.rank} of {self.size} reads 1/{self.size} of each "
                f"layer file ({self.bytes_read / 2**20:.2f} MiB read, "
                f"{self.bytes_gathered / 2**20:.2f} MiB all-gathered so far)")
