"""The KV cache of a block: one cache per micro-batch, each split by sequences over the tiers.

`BlockCache` is an HF `Cache` (generate() and the model's mask builders see an ordinary cache of
`get_seq_length()` tokens); its layers hold one `MicroKV` per micro-batch. The offloaded decoder
layer (schedule.py) hands each micro-batch a `MicroBatchView`, whose `update()` is the only call
a decoder layer makes on its cache.

Within a micro-batch of r sequences, `cache=(d, c, k)` keeps the first round(r*d/100) rows on
the compute device, the next ones in CPU RAM and the rest on disk (FlexGen splits a mixed cache
by sequences). Storage is token-major, [tokens, rows, heads, width], so appending a decode step is
one contiguous write (one `pwrite` on disk) and reading the cache is one contiguous read.
With `compress_cache`, K and V are stored as 4-bit min-max codes in groups along head_dim
(FlexGen; the group is `group_size`, or head_dim when the group does not divide it). On a CPU
compute device with the native kernels, a fused block's decode step attends straight over the
stored codes (`BlockCache.dsinfer_attend`, kernels/kv_quant.py's `attend_kv_int4`: FlexGen's
attention where the cache lives): the read ahead fetches codes, nothing is decoded and no dense
copy is made, about twice as fast as decoding the cache and attending over the copy
(docs/performance.md, "Behind the code"). Elsewhere (CUDA, HF's own layers, ALiBi, no
native kernels) the codes are decoded when read: a read decodes (or copies) into the
[rows, heads, tokens, D] layout attention takes, with room for the step's new token, so a
decode step makes one dense pass over the cache before attention reads it. The first update of
a cache (the prompt) is not read back: its K/V are the tokens just stored (decoded when 4-bit).
Reading a prompt's cache back from disk cost a flush of the pages just written at the disk's
write speed, on the compute thread, in every prefill layer (OPT-2.7B-shaped, 2 micro-batches of
16 x 512 tokens: 2.75-3.36 s per layer, against 2.13-2.22 s with the cache in RAM).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Executor, Future
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_dsinfer.errors import DSInferError
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels.decode import keep_rows
from hf_dsinfer.kernels.kv_quant import (
    KVInt4,
    KVSpan,
    attend_kv_int4,
    dequantize_kv_int4_tokens,
    quantize_kv_int4,
)
from hf_dsinfer.offload.files import DIRECT_ALIGN, aligned_size, aligned_view
from hf_dsinfer.offload.policy import OffloadPolicy

Component = tuple[str, int, torch.dtype]  # name, width (last dim), dtype
_STATS_LOCK = threading.Lock()
# Threads reading KV caches ahead. A whole-block decode step reads one cache file per
# micro-batch (5 MB each for OPT-2.7B's 16 micro-batches of one sequence at prompt 512) and
# copies it into the block's [rows, heads, tokens, D] tensor. Traced with one thread, the disk
# sat idle during each copy whenever the weight reader was between layers (docs/performance.md, "Behind the code").
# With several threads one copies while another reads.
# Each micro-batch's read fills its own rows, so they need no ordering.
KV_READ_THREADS = 4


def cache_group(head_dim: int, group_size: int) -> int:
    return group_size if head_dim % group_size == 0 else head_dim


def row_split(rows: int, percent: tuple[float, float, float]) -> list[tuple[str, int, int]]:
    """[(tier, first row, end row)] of a micro-batch of `rows` sequences, empty tiers dropped."""
    a = round(rows * percent[0] / 100)
    b = round(rows * (percent[0] + percent[1]) / 100)
    spans = [("device", 0, a), ("cpu", a, b), ("disk", b, rows)]
    return [s for s in spans if s[2] > s[1]]


# -- reusable read buffers ---------------------------------------------------------------------------
class BufferPool:
    """Buffers for what a decode step reads (raw file bytes, dense K/V), kept for the whole
    generate() call. Each step reads the whole cache again, and a fresh 50-200 MB tensor pays
    its page faults every time: decoding into fresh memory took over twice as long as into a
    reused buffer (docs/performance.md, "Behind the code"). A buffer is handed out again only once nothing holds a view of
    it any more (its storage's use count is back to the pool's own), so a tensor a caller kept
    is never overwritten; buffers are sized for the call's longest sequence."""

    def __init__(self):
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when idle)
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device, reserve: int = 0,
             align: int = 1) -> torch.Tensor:
        """A uint8 tensor of `nbytes` (address a multiple of `align`), from a buffer of at least
        max(nbytes, reserve) bytes."""
        with self._lock:
            for buffer, idle in self._buffers:
                if (buffer.device == device and buffer.numel() >= nbytes + align - 1
                        and _use_count(buffer) == idle):
                    return aligned_view(buffer, nbytes, align)
            buffer = torch.empty(max(nbytes, reserve) + align - 1, dtype=torch.uint8,
                                 device=device)
            if (idle := _use_count(buffer)) >= 0:
                self._buffers.append((buffer, idle))
            return aligned_view(buffer, nbytes, align)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               reserve_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        size = dtype.itemsize
        raw = self.take(math.prod(shape) * size, device,
                        math.prod(reserve_shape or shape) * size, 64)
        return raw.view(dtype).view(shape)

    def kv_pair(self, rows: int, heads: int, tokens: int, dim: int, dtype: torch.dtype,
                device: torch.device, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V [rows, heads, tokens, dim], from buffers with room for `capacity`
        tokens (so later, longer reads of the call reuse them)."""
        shape = (rows, heads, tokens, dim)
        reserve = (rows, heads, max(tokens, capacity), dim)
        return (self.tensor(shape, dtype, device, reserve),
                self.tensor(shape, dtype, device, reserve))

    def clear(self) -> None:
        with self._lock:
            self._buffers = []


def _use_count(buffer: torch.Tensor) -> int:
    """References to the buffer's storage (each tensor viewing it holds one); -1 where torch
    lacks the counter, and then the pool keeps nothing."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return counter(buffer.untyped_storage()._cdata) if counter is not None else -1


# -- storage -----------------------------------------------------------------------------------------
class RamStorage:
    """Growable token-major tensors, one per component, on one device."""

    def __init__(self, components: list[Component], rows: int, heads: int, device, capacity: int):
        self.tensors = {name: torch.empty(capacity, rows, heads, width, dtype=dtype, device=device)
                        for name, width, dtype in components}
        self.length = 0

    def append(self, parts: dict[str, torch.Tensor]) -> None:
        s = next(iter(parts.values())).shape[0]
        for name, part in parts.items():
            buf = self.tensors[name]
            if self.length + s > buf.shape[0]:
                grown = buf.new_empty(max(2 * buf.shape[0], self.length + s), *buf.shape[1:])
                grown[: self.length] = buf[: self.length]
                self.tensors[name] = buf = grown
            buf[self.length: self.length + s] = part
        self.length += s

    def read(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        return {name: t[start:stop] for name, t in self.tensors.items()}

    def close(self) -> None:
        self.tensors = {}


class FileStorage:
    """Token records [component bytes...] appended to one file; read back as one range."""

    def __init__(self, components: list[Component], rows: int, heads: int, path: Path,
                 pool: BufferPool, capacity: int):
        self.pool, self.capacity = pool, capacity
        self.layout = [(name, rows * heads * width * dtype.itemsize, (rows, heads, width), dtype)
                       for name, width, dtype in components]
        self.record = sum(n for _, n, _, _ in self.layout)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.direct_fd: int | None = -1  # opened on the first read; None: O_DIRECT refused
        self.length = 0

    def append(self, parts: dict[str, torch.Tensor]) -> None:
        s = next(iter(parts.values())).shape[0]
        raw = torch.cat([parts[name].contiguous().cpu().view(torch.uint8).reshape(s, -1)
                         for name, _, _, _ in self.layout], dim=1)  # [s, record]
        written = os.pwrite(self.fd, raw.numpy(), self.length * self.record)
        if written != raw.numel():
            raise DSInferError(f"KV cache file {self.path}: short write ({written} of "
                               f"{raw.numel()} bytes). Fix: free space in offload_dir.")
        self.length += s

    def read(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Tokens [start, stop) of every component, as views of one buffer filled by one read:
        O_DIRECT where the file system allows it (no page cache, which the memory budget counts,
        and no copy out of it; buffered reads were slower: docs/performance.md, "Behind the
        code"), else a buffered read."""
        n = stop - start
        first, end = start * self.record, stop * self.record
        raw = self._read_direct(first, end) if n else None
        if raw is None:
            raw = torch.empty(n * self.record, dtype=torch.uint8)
            if n and os.preadv(self.fd, [raw.numpy()], first) != raw.numel():
                raise self._truncated(stop)
        raw = raw.view(n, self.record)
        out, col = {}, 0
        for name, nbytes, shape, dtype in self.layout:
            part = raw[:, col: col + nbytes]  # [n, nbytes], rows strided by the record
            try:
                out[name] = part.view(dtype).view(n, *shape)  # no copy
            except RuntimeError:  # a record size the dtype cannot stride over
                out[name] = part.contiguous().view(dtype).view(n, *shape)
            col += nbytes
        return out

    def _read_direct(self, first: int, end: int) -> torch.Tensor | None:
        """Bytes [first, end) read with O_DIRECT (page-aligned span into a page-aligned buffer;
        the kernel writes back this range's dirty pages first), or None where it is refused."""
        if self.direct_fd is None:
            return None
        if self.direct_fd < 0:
            try:
                self.direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except (OSError, AttributeError):
                self.direct_fd = None
                return None
        lo = first - first % DIRECT_ALIGN
        buf = self.pool.take(aligned_size(end - lo), torch.device("cpu"),
                             aligned_size(self.capacity * self.record) + DIRECT_ALIGN,
                             DIRECT_ALIGN)
        try:
            got = os.preadv(self.direct_fd, [buf.numpy()], lo)
        except OSError:
            os.close(self.direct_fd)
            self.direct_fd = None
            return None
        if got < end - lo:
            raise self._truncated(end // self.record)
        return buf[first - lo: end - lo]

    def _truncated(self, stop: int) -> DSInferError:
        return DSInferError(f"KV cache file {self.path} is shorter than its {stop} tokens: it was "
                            "truncated while generating. Fix: keep offload_dir private to this "
                            "process.")

    def close(self) -> None:
        if self.direct_fd is not None and self.direct_fd >= 0:
            os.close(self.direct_fd)
        self.direct_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)


# -- one tier's rows of one micro-batch of one layer -------------------------------------------------
class KVSegment:
    """K and V of some rows on one tier, dense or 4-bit; read back dense on the compute device."""

    def __init__(self, tier: str, rows: int, heads: int, head_dim: int, dtype: torch.dtype,
                 policy: OffloadPolicy, device: torch.device, path: Path | None, capacity: int,
                 pool: BufferPool):
        self.group = cache_group(head_dim, policy.group_size) if policy.compress_cache else 0
        self.dtype, self.device = dtype, device
        self.heads, self.head_dim = heads, head_dim
        if self.group:
            g = head_dim // self.group
            components = [(f"{t}.{p}", w, dt) for t in ("k", "v") for p, w, dt in
                          (("packed", head_dim // 2, torch.uint8), ("scales", g, torch.float16),
                           ("mins", g, torch.float16))]
        else:
            components = [("k", head_dim, dtype), ("v", head_dim, dtype)]
        home = device if tier == "device" else torch.device("cpu")
        self.storage = (FileStorage(components, rows, heads, path, pool, capacity)
                        if tier == "disk" else
                        RamStorage(components, rows, heads, home, capacity))
        # a read is a free view only for dense RAM on the compute device itself
        self.cheap = not self.group and tier != "disk" and home == device

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [rows, heads, s, D] -> stored token-major."""
        parts = {}
        for name, x in (("k", k), ("v", v)):
            x = x.permute(2, 0, 1, 3)  # [s, rows, heads, D]
            if self.group:
                codes = quantize_kv_int4(x.contiguous(), self.group)
                parts.update({f"{name}.packed": codes.packed, f"{name}.scales": codes.scales,
                              f"{name}.mins": codes.mins})
            else:
                parts[name] = x
        self.storage.append(parts)
        return parts

    def span(self, parts: dict[str, torch.Tensor]) -> KVSpan:
        """4-bit components as `append` returns and the storage reads them, as the K and V
        codes attention reads (`attend_kv_int4`)."""
        k, v = (KVInt4(parts[f"{n}.packed"], parts[f"{n}.scales"], parts[f"{n}.mins"], self.group)
                for n in ("k", "v"))
        return KVSpan(k, v)

    def read(self, start: int, stop: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [rows, heads, stop - start, D] on the compute device, written into `out`
        when given (else new tensors, or views of the storage where that is free)."""
        return self.decode(self.storage.read(start, stop), out)

    def decode(self, parts: dict[str, torch.Tensor],
               out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored components ([tokens, rows, heads, width] each, as `append` returns and the
        storage reads them) as dense K, V [rows, heads, tokens, D] on the compute device. 4-bit
        codes on the CPU are decoded straight into that layout
        (kv_quant.dequantize_kv_int4_tokens)."""
        parts = {n: t.to(self.device, non_blocking=True) for n, t in parts.items()}
        result = []
        for i, name in enumerate(("k", "v")):
            dest = None if out is None else out[i]
            if self.group:
                codes = KVInt4(parts[f"{name}.packed"], parts[f"{name}.scales"],
                               parts[f"{name}.mins"], self.group)
                x = dequantize_kv_int4_tokens(codes, self.dtype, dest)
            else:
                x = parts[name].permute(1, 2, 0, 3)  # [rows, heads, n, D]
                if dest is not None:
                    x = dest.copy_(x)
            result.append(x)
        return result[0], result[1]

    def close(self) -> None:
        self.storage.close()


# -- one micro-batch of one layer --------------------------------------------------------------------
class MicroKV:
    """The cache of one micro-batch in one layer: segments by rows, and a prefetched read."""

    def __init__(self, segments: list[tuple[KVSegment, int, int]], stats: dict[str, float],
                 pool: BufferPool, capacity: int):
        self.segments = segments
        self.pool = pool
        self.capacity = capacity  # tokens the read buffers are sized for
        self.length = 0
        self._pending: tuple[int, Future] | None = None
        self._codes: tuple[int, Future] | None = None  # a read ahead of the stored codes
        self.stats = stats  # the BlockCache's: kv_read_s (summed over threads), kv_wait_s

    def prefetch(self, executor: Executor,
                 into: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Start reading the whole cache (before the next update) on the I/O thread, into tensors
        with room for one more token (`into`, [rows, heads, length + 1, D] each, when given):
        a decode step's update then writes its token in place."""
        if self.length and self._pending is None and not all(s.cheap for s, _, _ in self.segments):
            mode = torch.is_inference_mode_enabled()
            self._pending = (self.length, executor.submit(_in_inference_mode, mode, self.read, 0,
                                                          self.length, 1, into))

    def prefetch_codes(self, executor: Executor) -> None:
        """Start reading the stored codes of the whole cache (before the next `attend`) on an
        I/O thread: RAM segments give views, disk segments one read each."""
        if self.length and self._codes is None:
            mode = torch.is_inference_mode_enabled()
            self._codes = (self.length, executor.submit(_in_inference_mode, mode, self.read_codes,
                                                        0, self.length))

    def read_codes(self, start: int, stop: int) -> list[dict[str, torch.Tensor]]:
        """Each segment's stored components of tokens [start, stop), as the storage holds them."""
        began = time.perf_counter()
        parts = [segment.storage.read(start, stop) for segment, _, _ in self.segments]
        with _STATS_LOCK:
            self.stats["kv_read_s"] += time.perf_counter() - began
        return parts

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               keep: torch.Tensor | None, out: torch.Tensor) -> None:
        """Append one token's k, v [rows, heads, 1, D] (4-bit) and write into out
        [rows, heads_q, D] the attention of q [rows, heads_q, D] over the whole cache, computed
        on the stored codes (`attend_kv_int4`): no dense copy of the cache is made. keep:
        uint8 [rows or 1, T] (0 masks a key) or None."""
        start = self.length
        stored = [segment.append(k[r0:r1], v[r0:r1]) for segment, r0, r1 in self.segments]
        self.length += k.shape[2]
        self._drop_dense_read()
        if self._codes is not None:
            before, self._codes = self._await(self._codes, start), None
        else:
            before = self.read_codes(0, start)
        for (segment, r0, r1), old, new in zip(self.segments, before, stored):
            spans = [segment.span(old), segment.span(new)] if start else [segment.span(new)]
            attend_kv_int4(q[r0:r1], spans, scale, _rows_of(keep, r0, r1), out[r0:r1])

    def _await(self, pending: tuple[int, Future], start: int):
        """The result of a read ahead of the cache's first `start` tokens (the wait counted)."""
        upto, future = pending
        waited = time.perf_counter()
        result = future.result()
        self.stats["kv_wait_s"] += time.perf_counter() - waited
        assert upto == start, "a prefetched cache read is stale"
        return result

    def _drop_dense_read(self) -> None:
        if self._pending is not None:
            self._pending[1].result()
            self._pending = None

    def _drop_codes_read(self) -> None:
        if self._codes is not None:
            self._codes[1].result()
            self._codes = None

    def update(self, k: torch.Tensor, v: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [rows, heads, s, D]; return the whole cache, dense, [rows, heads, T, D]
        (written into `out`, [rows, heads, T, D] each, when given: the whole-block update
        assembles every micro-batch's rows in one tensor without a concatenation)."""
        self._drop_codes_read()  # read ahead for `attend`, which this step does not call
        start = self.length
        stored = [segment.append(k[r0:r1], v[r0:r1]) for segment, r0, r1 in self.segments]
        self.length += k.shape[2]
        if self._pending is not None:
            old, self._pending = self._await(self._pending, start), None
            if out is None and old[0].shape[2] == self.length:
                out = old  # read with room for this step's tokens
            elif out is None or not _same_view(out, old):  # (a block's read-ahead fills `out`)
                if out is None:
                    out = self._buffers(self.length)
                for dest, before in zip(out, old):
                    dest[:, :, :start] = before[:, :, :start]
        elif start:
            return self.read(0, self.length, into=out)
        elif out is None and not self.lossy:
            return k, v  # the cache held nothing: it is these tokens (see the module docstring)
        elif out is None:
            out = self._buffers(self.length)
        tail = (out[0][:, :, start:], out[1][:, :, start:])
        if self.lossy:  # attention sees the new tokens as stored, as later steps will read them
            for (segment, r0, r1), parts in zip(self.segments, stored):
                segment.decode(parts, (tail[0][r0:r1], tail[1][r0:r1]))
        else:  # dense storage holds exactly k, v
            _copy_pair(tail, (k, v))
        return out

    @property
    def lossy(self) -> bool:
        return any(segment.group for segment, _, _ in self.segments)

    def read(self, start: int, stop: int, extra: int = 0,
             into: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [rows, heads, stop - start (+ extra unwritten), D] of every segment (in
        `into` when given)."""
        began = time.perf_counter()
        if len(self.segments) == 1 and not extra and into is None and self.segments[0][0].cheap:
            out = self.segments[0][0].read(start, stop)  # views of the storage
        else:
            out = into if into is not None else self._buffers(stop - start + extra)
            self._read_into((out[0][:, :, :stop - start], out[1][:, :, :stop - start]), start,
                            stop)
        with _STATS_LOCK:  # reads run on several threads
            self.stats["kv_read_s"] += time.perf_counter() - began
        return out

    def _buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V [rows, heads, tokens, D] from the pool."""
        first = self.segments[0][0]
        return self.pool.kv_pair(self.segments[-1][2], first.heads, tokens, first.head_dim,
                                 first.dtype, first.device, self.capacity)

    def _read_into(self, out: tuple[torch.Tensor, torch.Tensor], start: int, stop: int) -> None:
        for segment, r0, r1 in self.segments:
            segment.read(start, stop, (out[0][r0:r1], out[1][r0:r1]))

    def close(self) -> None:
        self._drop_dense_read()
        self._drop_codes_read()
        for segment, _, _ in self.segments:
            segment.close()


def attends_in_cache(policy: OffloadPolicy, device: torch.device) -> bool:
    """Whether decode steps attend over the stored codes (BlockCache.dsinfer_attend): a 4-bit
    cache, a CPU compute device and the native kernels."""
    return policy.compress_cache and device.type == "cpu" and _native.lib() is not None


def _rows_of(keep: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of a keep mask ([B or 1, T]: one row is every row's)."""
    return keep if keep is None or keep.shape[0] == 1 else keep[start:stop]


def _in_inference_mode(mode: bool, fn, *args):
    """fn(*args) on an I/O thread in the caller's inference mode (it is thread-local): a read
    fills buffers that the caller's thread may have made, and in-place writes to inference
    tensors are refused outside inference mode."""
    with torch.inference_mode(mode):
        return fn(*args)


def _same_view(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
               for x, y in zip(a, b))


def _copy_pair(out: tuple[torch.Tensor, torch.Tensor],
               src: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out[0].copy_(src[0])
    out[1].copy_(src[1])
    return out


# -- HF cache objects --------------------------------------------------------------------------------
class BlockKVLayer(CacheLayerMixin):
    """One decoder layer's cache: a MicroKV per micro-batch, created at the first update."""

    is_sliding = False
    is_compileable = False

    def __init__(self, index: int, owner: BlockCache):
        super().__init__()
        self.index = index
        self.owner = owner
        self.micro: list[MicroKV] = []
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None  # see prefetch_block

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        self.micro = [self.owner.new_micro(self.index, m, heads, head_dim, key_states.dtype)
                      for m in range(len(self.owner.rows))]
        self.is_initialized = True

    def update_micro(self, m: int, k: torch.Tensor, v: torch.Tensor, out=None):
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        return self.micro[m].update(k, v, out)

    def update(self, key_states, value_states, *args, **kwargs):
        """A whole-block update (a layer called without the micro-batch loop): split by rows,
        each micro-batch writing its rows of one [B, heads, T, D] pair."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.owner.rows) == 1:
            return self.update_micro(0, key_states, value_states)
        total = self.get_seq_length() + key_states.shape[2]
        out, self._block = self._block, None
        if out is None or out[0].shape[2] != total:
            out = self.owner.pool.kv_pair(sum(self.owner.rows), key_states.shape[1], total,
                                          key_states.shape[3], key_states.dtype,
                                          key_states.device, self.owner.capacity)
        start = 0
        for m, rows in enumerate(self.owner.rows):
            rows_out = (out[0][start:start + rows], out[1][start:start + rows])
            self.update_micro(m, key_states[start:start + rows],
                              value_states[start:start + rows], rows_out)
            start += rows
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               keep: torch.Tensor | None) -> torch.Tensor:
        """A decode step of the whole block over the stored codes (see BlockCache.dsinfer_attend):
        q [B, heads_q, 1, D] -> [B, heads_q, 1, D]."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        q = q[:, :, 0].contiguous()
        out = torch.empty_like(q)
        start = 0
        for micro, rows in zip(self.micro, self.owner.rows):
            stop = start + rows
            micro.attend(q[start:stop], k[start:stop], v[start:stop], scale,
                         _rows_of(keep, start, stop), out[start:stop])
            start = stop
        return out.unsqueeze(2)

    def prefetch_micro(self, m: int, executor: Executor) -> None:
        if self.is_initialized:
            self.micro[m].prefetch(executor)

    def prefetch_block(self, executor: Executor) -> None:
        """Read every micro-batch's cache ahead for a whole-block decode step: with several
        micro-batches, straight into their rows of one block tensor, which the step's update
        then returns without assembling a copy."""
        if not self.is_initialized:
            return
        if self.owner.attends:  # the step attends over the codes: read them, decode nothing
            for micro in self.micro:
                micro.prefetch_codes(executor)
            return
        if len(self.micro) == 1 or self._block is not None:
            for micro in self.micro:
                micro.prefetch(executor)
            return
        seg = self.micro[0].segments[0][0]
        self._block = block = self.owner.pool.kv_pair(
            sum(self.owner.rows), seg.heads, self.get_seq_length() + 1, seg.head_dim, seg.dtype,
            seg.device, self.owner.capacity)
        start = 0
        for micro, rows in zip(self.micro, self.owner.rows):
            micro.prefetch(executor, (block[0][start:start + rows], block[1][start:start + rows]))
            start += rows

    def get_seq_length(self) -> int:
        return self.micro[0].length if self.micro else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise DSInferError("hf_dsinfer offload: beam search is not supported by the offloaded "
                           "block cache. Fix: use greedy or sampling (num_beams=1).")

    def close(self) -> None:
        for micro in self.micro:
            micro.close()
        self.micro = []
        self.is_initialized = False


class BlockCache(Cache):
    """The cache of one block of micro-batches (`rows[m]` sequences each), per the policy."""

    def __init__(self, num_layers: int, rows: list[int], policy: OffloadPolicy,
                 device: torch.device, folder: Path | None, capacity: int,
                 stats: dict[str, float] | None = None, attends: bool = True):
        self.rows = rows
        # decode steps attend over the stored 4-bit codes (dsinfer_attend); the engine says
        # whether its layers will ask (fused blocks do), so reads ahead fetch codes, not dense K/V
        self.attends = attends and attends_in_cache(policy, device)
        self.policy = policy
        self.device = device
        self.folder = folder
        self.capacity = capacity
        self.stats = ({"kv_read_s": 0.0, "kv_wait_s": 0.0, "kv_attend": 0} if stats is None
                      else stats)
        self.pool = BufferPool()  # the steps' read buffers, shared by every layer
        super().__init__(layers=[BlockKVLayer(j, self) for j in range(num_layers)])

    def new_micro(self, layer: int, m: int, heads: int, head_dim: int,
                  dtype: torch.dtype) -> MicroKV:
        segments = []
        for tier, r0, r1 in row_split(self.rows[m], self.policy.cache):
            path = None if tier != "disk" else self.folder / f"kv_L{layer:04d}_m{m:03d}.bin"
            segments.append((KVSegment(tier, r1 - r0, heads, head_dim, dtype, self.policy,
                                       self.device, path, self.capacity, self.pool), r0, r1))
        return MicroKV(segments, self.stats, self.pool, self.capacity)

    def dsinfer_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                       scale: float, mask: torch.Tensor | None) -> torch.Tensor | None:
        """FlexGen's attention where the cache lives, for a decode step of the whole block:
        append the step's k, v [B, kv_heads, 1, D] and return softmax(scale q K^T + mask) V
        [B, heads, 1, D], computed straight on the stored 4-bit codes (no dense copy of the
        cache, none decoded). None, with nothing appended, where this cache does not: a dense
        cache, a CUDA device, no native kernels, more than one token, or a mask keep_rows
        does not take (per head, or adding values other than 0 and masked); the caller then
        runs `update` and its own attention. Fused blocks (injection/fused.py) call it."""
        if not self.attends or k.shape[2] != 1 or q.shape[2] != 1:
            return None
        layer = self.layers[layer_idx]
        usable, keep = keep_rows(mask, q.shape[0], layer.get_seq_length() + 1)
        if not usable:
            return None
        self.stats["kv_attend"] += 1
        return layer.attend(q, k, v, scale, keep)

    def view(self, m: int) -> MicroBatchView:
        return MicroBatchView(self, m)

    def close(self) -> None:
        for layer in self.layers:
            layer.close()
        self.pool.clear()
        if self.folder is not None and self.folder.exists():
            for leftover in self.folder.glob("kv_*.bin"):
                leftover.unlink()
            self.folder.rmdir()


class MicroBatchView:
    """What one micro-batch's decoder-layer call sees as its cache."""

    def __init__(self, cache: BlockCache, m: int):
        self.cache = cache
        self.m = m

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.cache.layers[layer_idx].update_micro(self.m, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.layers[layer_idx].get_seq_length()
