"""FlexGen's cost model, with hardware constants measured on this machine.

Per decoder layer and block of `bs` sequences (prompt s, n new tokens, KV bytes per token k):

    prefill  T_pre >= disk reads   w_disk * W / disk_read                 (+ host->device
             T_pre >= cache writes c_disk * bs*s*k / disk_write            copies on CUDA)
             T_pre >= compute      2*bs*s*P / flops + attention + decompression
    decode   T_dec >= disk reads   (w_disk * W + c_disk * bs*(s+n/2)*k) / disk_read
             T_dec >= cache writes c_disk * bs*k / disk_write
             T_dec >= compute      max(2*bs*P / flops, resident bytes / memory bandwidth)
                                   + attention over the cache + decompression
    total    L * (T_pre + (n - 1) * T_dec) + n * lm_head,  throughput = bs * n / total

A block of several micro-batches multiplies every layer once per micro-batch, so its compute
term is  n_micro * max(flops / n_micro / FLOP/s, layer bytes / memory bandwidth).

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
import tempfile
import time
from pathlib import Path

import torch

from hf_dsinfer.hardware import median_time, read_bandwidth
from hf_dsinfer.offload.compression import compress, decompress
from hf_dsinfer.offload.memory import ModelShape
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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        return cls(**json.loads(text))


# -- measuring ---------------------------------------------------------------------------------------
def measure_hardware(folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cpu", disk_mib: int = 256) -> Hardware:
    """Measure the constants the cost model needs (a few seconds)."""
    dev = torch.device(device)
    read, write = measure_disk(Path(folder), disk_mib)
    return Hardware(device=str(dev), flops=measure_flops(dtype, dev),
                    memory_bw=read_bandwidth(dev, 0.5) * 1e9, disk_read=read, disk_write=write,
                    h2d=measure_h2d(dev), decompress=measure_decompress(dtype, dev))


def measure_flops(dtype: torch.dtype, device: torch.device, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_time(lambda i: a @ b, 3, device)
    return 2 * n**3 / seconds


def measure_disk(folder: Path, mib: int) -> tuple[float, float]:
    """(read, write) bytes/s of `folder`'s disk, page cache dropped so the disk is really read."""
    folder.mkdir(parents=True, exist_ok=True)
    data = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8).numpy()
    fd, name = tempfile.mkstemp(dir=folder, prefix=".bw_probe_")
    try:
        start = time.perf_counter()
        os.write(fd, data.tobytes())
        os.fsync(fd)
        write = data.nbytes / (time.perf_counter() - start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = torch.empty(mib << 20, dtype=torch.uint8)
        start = time.perf_counter()
        os.preadv(fd, [out.numpy()], 0)
        read = data.nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(name)
    return read, write


def measure_h2d(device: torch.device) -> float:
    if device.type != "cuda":
        return float("inf")
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    seconds = median_time(lambda i: host.to(device, non_blocking=True), 3, device)
    return host.numel() / seconds


def measure_decompress(dtype: torch.dtype, device: torch.device) -> float:
    weight = torch.randn(2048, 4096, device=device).to(dtype)
    packed = compress(weight, 64)
    out = torch.empty_like(weight)
    seconds = median_time(lambda i: decompress(packed, dtype, out=out), 3, device)
    return weight.numel() * weight.element_size() / seconds


# -- the model -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    prompt_len: int
    gen_len: int


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
    # each micro-batch multiplies by the whole layer: compute-bound, or bound by reading the
    # layer's weights from the compute device's memory, whichever is slower
    micros = -(-batch // micro)
    compute0 = micros * max(flops / micros / hw.flops, dense / hw.memory_bw)
    if not prefill:  # and attention reads the whole cache
        compute0 += batch * ctx * kv_dense / hw.memory_bw
    if compress_w:
        compute0 += dense / hw.decompress
    compute = [0.0] * 6
    if compress_c and not prefill:  # decoding the whole cache of the step, wherever it lives
        compute0 += batch * ctx * kv_dense / hw.decompress
    return {"read": read, "read0": 0.0, "write": write, "write0": 0.0, "compute": compute,
            "compute0": compute0}


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
