"""FlexGen's cost model, with hardware constants measured on this machine.

Per decoder layer and block of `bs` sequences (prompt s, n new tokens, KV bytes per token k):

    prefill  T_pre >= disk reads   w_disk * W / disk_read                 (+ host->device
             T_pre >= cache writes c_disk * bs*s*k / disk_write            copies on CUDA)
             T_pre >= compute      2*bs*s*P / flops + attention + decompression, or, with
                                   the model's own layer timed (search.measure_prefill_layer),
                                   bs * that time + decompression
    decode   T_dec >= disk reads   (w_disk * W + c_disk * bs*(s+n/2)*k) / disk_read
             T_dec >= cache writes c_disk * bs*k / disk_write
             T_dec >= compute      max(2*bs*P / flops, resident bytes / memory bandwidth)
                                   + attention over the cache + decompression
                                   (a 4-bit cache on the CPU: attention straight over the
                                   codes, bs*(s+n/2)*k / its measured rate, nothing decoded)
    total    L * (T_pre + (n - 1) * T_dec) + n * lm_head,  throughput = bs * n / total

A block of several micro-batches multiplies every layer once per micro-batch, so its compute
term is  n_micro * max(flops / n_micro / FLOP/s, layer bytes / memory bandwidth)  on CUDA and in
every prefill; a CPU decode step runs the whole block in one pass (see `_matmul_seconds`, which
also prices 4-bit weights: packed int4 matmuls in a CPU decode step, one dequantize per layer
otherwise).

With overlap the terms of one step run concurrently (hence the maxima); without, they add up.
W: a layer's stored bytes (4-bit when compressed), P its parameters. On a CPU compute device
there is no host<->device copy, and decompressing 4-bit codes is CPU work, so it is compute.
Everything is linear in the placement fractions, which is what lets `search` solve for them
with a linear program.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hf_dsinfer import settings
from hf_dsinfer.hardware import median_time, read_bandwidth
from hf_dsinfer.kernels import crossovers
from hf_dsinfer.kernels.kv_quant import (
    KVSpan,
    attend_kv_int4,
    dequantize_kv_int4_tokens,
    quantize_kv_int4,
)
from hf_dsinfer.kernels.quant import dequantize_int4_rows, linear_int4_cpu
from hf_dsinfer.offload.compression import compress, decompress
from hf_dsinfer.offload.memory import ModelShape
from hf_dsinfer.offload.packed import pack_weight
from hf_dsinfer.offload.policy import OffloadPolicy


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Measured constants (bytes/s and FLOP/s) of the compute device, its memory and the disk."""

    device: str
    flops: float  # dense matmul in the compute dtype, large batch
    memory_bw: float  # compute-device memory read bandwidth
    disk_read: float
    disk_write: float
    h2d: float  # host -> device copy (inf on a CPU compute device)
    decompress: float  # dense bytes produced per second by 4-bit decompression
    # CPU only: weights x rows per second of the packed int4 matmul (few rows), and dense
    # bytes per second of decoding a 4-bit KV cache
    int4_mm: float = float("inf")
    kv_decompress: float = float("inf")
    # K + V bytes per second through the attention kernel at one query (a decode step)
    attn_decode: float = float("inf")
    # CPU only: stored 4-bit K + V bytes (codes, scales, mins) per second through the decode
    # attention over the codes (kv_quant.attend_kv_int4); inf where it does not run (no native
    # kernels): then a 4-bit cache is decoded, and attention reads the dense copy
    attn_int4: float = float("inf")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        return cls(**json.loads(text))


# -- measuring ---------------------------------------------------------------------------------------
# bumped when a probe changes what it measures, so that ~/.cache's older results are not reused
PROBES_VERSION = 3


def cache_file() -> Path:
    """Where measured hardware is kept: under the settings' cache_dir (hf_dsinfer.settings)."""
    return settings.current().cache_dir / "hardware.json"


def measure_hardware(folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cpu", disk_mib: int = 512, cache: bool = False,
                     sample: str | Path | None = None) -> Hardware:
    """Measure the constants the cost model needs (~10-20 s: every probe is repeated and its
    median kept, because this machine is shared and one short probe once read the disk at a
    quarter of its speed). `sample`: a checkpoint (file or folder) whose data the disk read
    probe reads, see measure_disk. With `cache`, a result measured before for the same machine,
    folder file system, device, dtype, probe size and kind of read probe is reused
    (hardware.json under ~/.cache)."""
    old = old_data_windows(sample, Path(folder), disk_mib)
    key = _cache_key(Path(folder), dtype, device, disk_mib, bool(old))
    if cache and (hit := _cached(key)) is not None:
        return hit
    dev = torch.device(device)
    read, write = measure_disk(Path(folder), disk_mib, old=old)
    hw = Hardware(device=str(dev), flops=measure_flops(dtype, dev),
                  memory_bw=read_bandwidth(dev, 0.5) * 1e9, disk_read=read, disk_write=write,
                  h2d=measure_h2d(dev), decompress=measure_decompress(dtype, dev),
                  int4_mm=measure_int4_mm(dtype, dev), kv_decompress=measure_kv_decompress(dtype, dev),
                  attn_decode=measure_attn_decode(dtype, dev),
                  attn_int4=measure_attn_int4(dtype, dev))
    _store(key, hw)
    return hw


def _existing(folder: Path) -> Path:
    return folder if folder.exists() else next(p for p in folder.parents if p.exists())


def _cache_key(folder: Path, dtype: torch.dtype, device: str, disk_mib: int,
               old_data: bool) -> str:
    return json.dumps([os.uname().nodename, os.cpu_count(), os.stat(_existing(folder)).st_dev,
                       str(dtype), device, disk_mib, torch.get_num_threads(), old_data,
                       PROBES_VERSION])


def _cached(key: str) -> Hardware | None:
    try:
        entry = json.loads(cache_file().read_text()).get(key)
    except (OSError, ValueError):
        return None
    fields = {f.name for f in dataclasses.fields(Hardware)}
    if not isinstance(entry, dict) or set(entry) != fields:
        return None  # absent, or written before a constant was added / renamed: re-measure
    return Hardware(**entry)


def _store(key: str, hw: Hardware) -> None:
    try:
        data = json.loads(cache_file().read_text()) if cache_file().exists() else {}
        data[key] = dataclasses.asdict(hw)
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        cache_file().write_text(json.dumps(data, indent=1))
    except (OSError, ValueError):
        pass  # a cache that cannot be written only costs a re-measurement


def measure_flops(dtype: torch.dtype, device: torch.device, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_time(lambda i: a @ b, 5, device)
    return 2 * n**3 / seconds


def old_data_windows(sample: str | Path | None, folder: Path, mib: int,
                     count: int = 5) -> list[tuple[Path, int]]:
    """Up to `count` disjoint (file, offset) windows of `mib` MiB in the files of `sample` (a
    file, or a folder's *.safetensors / *.bin) that lie on the same file system as `folder`,
    largest files first; [] when there is none."""
    if sample is None or not Path(sample).exists():
        return []
    sample = Path(sample)
    files = [sample] if sample.is_file() else [*sample.glob("*.safetensors"),
                                               *sample.glob("*.bin")]
    device = os.stat(_existing(folder)).st_dev
    files = sorted((f for f in files if os.stat(f).st_dev == device),
                   key=lambda f: f.stat().st_size, reverse=True)
    window = mib << 20
    spans = [(f, i * window) for f in files for i in range(f.stat().st_size // window)]
    return spans[:count]


def measure_disk(folder: Path, mib: int, reps: int = 5,
                 old: list[tuple[Path, int]] | None = None) -> tuple[float, float]:
    """(read, write) bytes/s of `folder`'s disk, medians. Write: a `mib` file written and
    fsync'ed, the way the weight store writes. Read: O_DIRECT where allowed, else buffered with
    the page cache dropped.

    A file just written reads back faster than the engine's data: the VM host's cache holds it
    (O_DIRECT bypasses only the guest's), and an offloaded decode saw about half the rate of a
    read-back (docs/performance.md, "Behind the code"). So given `old` windows (old_data_windows: data on the same disk
    this probe did not write, e.g. the checkpoint being planned for), each read reads one
    window, by two threads at once as the engine's weight and KV readers do. Without any it
    reads its own file back `reps` times: an upper bound, which hardware.json keys apart."""
    from hf_dsinfer.offload import files

    folder.mkdir(parents=True, exist_ok=True)
    data = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
    path = folder / f".bw_probe_{os.getpid()}.safetensors"
    writes, reads = [], []
    try:
        for _ in range(2):
            start = time.perf_counter()
            files.write_file(path, {"probe": data})  # save, fsync, rename (+ its CRC pass)
            writes.append(data.numel() / (time.perf_counter() - start))
        if old:
            reads = _read_windows(old, mib << 20)
        else:
            reader = files.SafetensorsFile(path)
            out = files.aligned_buffer(files.aligned_size(reader.size))
            for _ in range(reps):
                start = time.perf_counter()
                reader.read_all(out)
                reads.append(reader.size / (time.perf_counter() - start))
            reader.close()
    finally:
        path.unlink(missing_ok=True)
    return statistics.median(reads), max(writes)


def _read_windows(windows: list[tuple[Path, int]], nbytes: int) -> list[float]:
    """Bytes/s of reading each (file, offset) window of `nbytes`, by two concurrent threads, one
    half each, into two buffers touched before the first read and reused (as the engine's
    pooled buffers are: a fresh buffer would time its page faults too): O_DIRECT where the file
    system allows it, else buffered with the pages dropped."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_dsinfer.offload import files

    half = files.aligned_size(nbytes // 2)
    buffers = [files.aligned_buffer(half).fill_(0) for _ in range(2)]
    rates = []
    with ThreadPoolExecutor(2) as pool:
        for path, offset in windows:
            direct = getattr(os, "O_DIRECT", 0)
            try:
                fd = os.open(path, os.O_RDONLY | direct)
            except OSError:  # tmpfs and some overlay mounts refuse O_DIRECT
                direct, fd = 0, os.open(path, os.O_RDONLY)

            def read(start: int, out: torch.Tensor, fd=fd, direct=direct) -> int:
                got = os.preadv(fd, [out.numpy()], start)
                if not direct:
                    os.posix_fadvise(fd, start, half, os.POSIX_FADV_DONTNEED)
                return got

            try:
                start = time.perf_counter()
                got = sum(pool.map(read, (offset, offset + half), buffers))
                rates.append(got / (time.perf_counter() - start))
            finally:
                os.close(fd)
    return rates


def measure_h2d(device: torch.device) -> float:
    if device.type != "cuda":
        return float("inf")
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    seconds = median_time(lambda i: host.to(device, non_blocking=True), 3, device)
    return host.numel() / seconds


def measure_decompress(dtype: torch.dtype, device: torch.device) -> float:
    """Dense bytes/s of decoding 4-bit weights: a packed weight's whole-matrix dequantize on a
    CPU (once per layer per prefill, PackedInt4Linear.materialize), FlexGen's codes on CUDA."""
    weight = torch.randn(4096, 2048, device=device).to(dtype)
    if device.type == "cpu":
        packed = pack_weight(weight, 64)
        seconds = median_time(lambda i: dequantize_int4_rows(packed, dtype, 0, 4096), 3, device)
    else:
        codes = compress(weight, 64)
        out = torch.empty_like(weight)
        seconds = median_time(lambda i: decompress(codes, dtype, out=out), 3, device)
    return weight.numel() * weight.element_size() / seconds


def measure_int4_mm(dtype: torch.dtype, device: torch.device, rows: int = 8) -> float:
    """Weights x rows per second of the packed int4 CPU matmul at a few rows (decode): the
    native kernel where it runs, else dequantize + matmul (what PackedInt4Linear runs)."""
    if device.type != "cpu":
        return float("inf")
    weight = torch.randn(4096, 4096).to(dtype)
    packed = pack_weight(weight, 64)
    x = torch.randn(rows, 4096).to(dtype)
    seconds = median_time(lambda i: linear_int4_cpu(x, packed), 5, device)
    return weight.numel() * rows / seconds


def measure_kv_decompress(dtype: torch.dtype, device: torch.device) -> float:
    """Dense bytes/s of decoding a 4-bit KV cache (token-major, groups along head_dim) into the
    layout attention reads, as the offloaded cache does (all threads: on the I/O thread it
    shares the cores with the compute team). A decode step decodes a whole block's cache, far
    larger than the CPU's caches, so the probe rotates over three caches of 16 sequences x 512
    tokens (42 MB dense each): one cache of 8 sequences decoded again and again stayed in cache
    and read much faster than a block's cache decodes (docs/performance.md, "Behind the code")."""
    sets = []
    for _ in range(3):
        kv = torch.randn(512, 16, 32, 80, device=device).to(dtype)  # [tokens, rows, heads, D]
        sets.append((quantize_kv_int4(kv, 80),
                     torch.empty(16, 32, 512, 80, dtype=dtype, device=device)))
    seconds = median_time(lambda i: dequantize_kv_int4_tokens(sets[i % 3][0], dtype,
                                                              sets[i % 3][1]), 7, device)
    return kv.numel() * kv.element_size() / seconds


def measure_attn_decode(dtype: torch.dtype, device: torch.device) -> float:
    """K + V bytes/s of a decode step's attention (one query per sequence and head, 512 keys,
    16 sequences) through the kernel the fused blocks call, over three caches in turn so that
    none is still in cache: on the CPU below the memory bandwidth (docs/performance.md, "Behind the code"), so the
    model prices attention at this rate."""
    from hf_dsinfer.kernels.attention import attention

    sets = [(torch.randn(16, 32, 1, 80, device=device).to(dtype),
             torch.randn(16, 32, 512, 80, device=device).to(dtype),
             torch.randn(16, 32, 512, 80, device=device).to(dtype)) for _ in range(3)]
    seconds = median_time(lambda i: attention(*sets[i % 3], scale=80 ** -0.5), 6, device)
    k = sets[0][1]
    return 2 * k.numel() * k.element_size() / seconds


def measure_attn_int4(dtype: torch.dtype, device: torch.device) -> float:
    """Stored K + V bytes/s of a decode step's attention straight over a 4-bit cache (the
    offload engine's decode steps on the CPU, `attend_kv_int4`), 16 sequences x 32 heads x 512
    tokens x 80 (OPT's head), over three caches in turn; inf where the native kernel does not
    run (the engine then decodes the cache, priced by kv_decompress and attn_decode)."""
    from hf_dsinfer.offload.cache import attends_in_cache
    from hf_dsinfer.offload.policy import OffloadPolicy

    if not attends_in_cache(OffloadPolicy(compress_cache=True), device):
        return float("inf")
    sets = []
    for _ in range(3):
        k, v = (quantize_kv_int4(torch.randn(512, 16, 32, 80).to(dtype), 80) for _ in range(2))
        sets.append((torch.randn(16, 32, 80).to(dtype), [KVSpan(k, v)]))
    seconds = median_time(lambda i: attend_kv_int4(*sets[i % 3], 80 ** -0.5), 6, device)
    span = sets[0][1][0]
    return 2 * sum(t.numel() * t.element_size() for t in span.k[:3]) / seconds





# -- the model -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    """What is run: prompt and generated lengths, and optionally the measured prefill of one
    layer for one sequence of this prompt (search.measure_prefill_layer; `plan` measures it). Without
    it the prefill's compute is priced by FLOPs at the matmul probe's rate."""

    prompt_len: int
    gen_len: int
    prefill_layer_s: float | None = None


@dataclasses.dataclass(frozen=True)
class StepTerms:
    """The terms whose max (overlap) or sum (no overlap) is one layer step's time, seconds."""

    read: float
    write: float
    compute: float

    def time(self, overlap: bool) -> float:
        parts = (self.read, self.write, self.compute)
        return max(parts) if overlap else sum(parts)


def layer_terms(shape: ModelShape, hw: Hardware, policy: OffloadPolicy, work: Workload,
                batch: int, prefill: bool) -> StepTerms:
    """Per-layer prefill or decode-step terms of the cost model (see the module docstring)."""
    wf = [p / 100 for p in policy.weights]
    cf = [p / 100 for p in policy.cache]
    coef = layer_coefficients(shape, hw, work, batch, policy.micro_batch_size, prefill,
                              policy.compress_weights, policy.compress_cache, policy.group_size)
    read = sum(c * x for c, x in zip(coef["read"], wf + cf)) + coef["read0"]
    write = sum(c * x for c, x in zip(coef["write"], wf + cf)) + coef["write0"]
    compute = sum(c * x for c, x in zip(coef["compute"], wf + cf)) + coef["compute0"]
    return StepTerms(read, write, compute)


def layer_coefficients(shape: ModelShape, hw: Hardware, work: Workload, batch: int,
                       micro: int, prefill: bool, compress_w: bool, compress_c: bool,
                       group: int) -> dict[str, list[float] | float]:
    """Each term as constant + sum(coef * fraction) over the fractions
    (w_dev, w_cpu, w_disk, c_dev, c_cpu, c_disk): the LP's rows."""
    cuda = hw.device.startswith("cuda")
    stored = shape.layer_bytes(compress_w, group)
    dense = shape.layer_numel * shape.dtype_bytes
    kv_tok = shape.kv_token_bytes(compress_c, group)
    kv_dense = 2 * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    ctx = work.prompt_len if prefill else work.prompt_len + work.gen_len / 2
    new_tokens = batch * (work.prompt_len if prefill else 1)
    kv_stored = batch * ctx * kv_tok  # cache bytes a step reads (decode)
    h2d = 0.0 if not cuda else 1 / hw.h2d
    read = [0.0, stored * h2d, stored * (1 / hw.disk_read + h2d), 0.0, 0.0, 0.0]
    if not prefill:  # the step reads the whole cache to where attention runs
        read[4] += kv_stored * h2d
        read[5] += kv_stored * (1 / hw.disk_read + h2d)
    write = [0.0] * 6
    write[5] = new_tokens * kv_tok / hw.disk_write
    flops = 2 * new_tokens * shape.layer_numel + 4 * new_tokens * ctx * shape.hidden
    compute0 = _matmul_seconds(shape, hw, batch, micro, prefill, compress_w, flops, dense,
                               work.prefill_layer_s)
    compute = [0.0] * 6
    codes_attention = compress_c and not cuda and hw.attn_int4 != float("inf")
    if not prefill and codes_attention:  # attention runs straight over the stored codes,
        # wherever they were read from (BlockCache.dsinfer_attend): nothing decoded or copied
        compute0 += kv_stored / hw.attn_int4
    elif not prefill:  # attention reads the whole cache, at the measured rate of the kernel;
        # on the CPU a dense cache read from disk is first copied into attention's layout (one
        # more pass; a 4-bit cache is decoded straight into it, priced below). RAM gives views
        # only to a block of one micro-batch: the CPU decode step runs the whole block at once,
        # so several micro-batches' RAM caches are copied into one block tensor (about half
        # of a layer step on OPT-2.7B's shape: docs/performance.md, "Behind the code")
        compute0 += batch * ctx * kv_dense / min(hw.attn_decode, hw.memory_bw)
        if not cuda and not compress_c:
            compute[5] += batch * ctx * kv_dense / hw.memory_bw
            if batch > micro:
                compute[4] += batch * ctx * kv_dense / hw.memory_bw
        if compress_c:  # decoding the whole cache of the step, wherever it lives
            compute0 += batch * ctx * kv_dense / (hw.decompress if cuda else hw.kv_decompress)
    return {"read": read, "read0": 0.0, "write": write, "write0": 0.0, "compute": compute,
            "compute0": compute0}


def _matmul_seconds(shape: ModelShape, hw: Hardware, batch: int, micro: int, prefill: bool,
                    compress_w: bool, flops: float, dense: float,
                    prefill_layer_s: float | None = None) -> float:
    """The layer's matrix products for one step of the block.

    Every pass over the weights is compute-bound or bound by reading them from the compute
    device's memory, whichever is slower. CUDA (and any prefill) runs one pass per micro-batch;
    a CPU decode step runs the whole block in one pass. 4-bit weights: on CUDA they are
    decompressed per use; on the CPU a decode step of at most int4_native_max_rows rows
    (kernels/crossovers.py) multiplies by the packed codes (int4_mm), and more rows (a prefill)
    dequantize the layer once (a decode step of more rows, up to the panel kernel's
    int4_gemm_max_rows in bf16, also runs on the codes, at about dense GEMM speed: priced here as
    dequantize + GEMM, which is slower, so the model errs against 4-bit weights there). A prefill measured on the model's own layer (`prefill_layer_s`, one sequence) is
    priced as that time per sequence: it includes the layer's attention and other work."""
    cuda = hw.device.startswith("cuda")
    passes = -(-batch // micro) if (prefill or cuda) else 1
    work = (batch * prefill_layer_s if prefill and prefill_layer_s is not None
            else flops / hw.flops)
    one_pass = max(work / passes, dense / hw.memory_bw)
    if (compress_w and not cuda and not prefill
            and batch <= crossovers.rows().int4_native_max_rows):
        return max(flops / hw.flops, shape.layer_numel * batch / hw.int4_mm)
    decode = dense / hw.decompress if compress_w else 0.0
    return passes * one_pass + decode


@dataclasses.dataclass(frozen=True)
class Prediction:
    prefill_s: float
    decode_s: float  # all n - 1 decode steps
    batch: int
    gen_len: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run (FlexGen's metric)."""
        return self.batch * self.gen_len / self.total_s

    @property
    def decode_throughput(self) -> float:
        return self.batch * max(self.gen_len - 1, 1) / max(self.decode_s, 1e-12)


def head_seconds(shape: ModelShape, hw: Hardware, batch: int) -> float:
    """One step of the layers outside the blocks (lm_head; generate() computes the logits of
    the last position only): compute- or memory-bound."""
    params = shape.vocab * shape.hidden
    return max(2 * batch * params / hw.flops, params * shape.dtype_bytes / hw.memory_bw)


def predict(shape: ModelShape, hw: Hardware, policy: OffloadPolicy, work: Workload,
            batch: int | None = None) -> Prediction:
    """Predicted times of one block (`batch` sequences, default the policy's block size)."""
    batch = batch or policy.block_size
    pre = layer_terms(shape, hw, policy, work, batch, True).time(policy.overlap)
    dec = layer_terms(shape, hw, policy, work, batch, False).time(policy.overlap)
    layers, head = shape.num_layers, head_seconds(shape, hw, batch)
    steps = max(work.gen_len - 1, 0)
    return Prediction(layers * pre + head, (layers * dec + head) * steps, batch, work.gen_len)
