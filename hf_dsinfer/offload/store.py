"""Decoder-layer weights stored per tier, and loaded back one layer at a time.

Placement (FlexGen): inside every layer the parameters, in registration order, are split by
cumulative bytes: a tensor goes to the tier its byte midpoint falls in, so `weights=(20, 50, 30)`
puts about the first 20% of each layer's bytes on the compute device, the next 50% in CPU RAM and
the rest on disk, the same split for every layer.

    device tier  dense: stays bound to the module for good; compressed: codes on the device
    cpu tier     host RAM (pinned when the compute device is CUDA); on a CPU compute device a
                 dense cpu-tier tensor is the same as a device-tier one and stays bound
    disk tier    one safetensors file per layer under offload_dir/weights/<fingerprint>/,
                 written once with a progress bar, reused while the fingerprint matches

`load(j)` returns the dense tensors of layer j that are not permanently bound, on the compute
device: it reads disk files, copies host tensors to CUDA (pinned staging, side stream) and
decompresses 4-bit codes. It is what the prefetch thread runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_dsinfer.kernels.kv_quant import KVInt4
from hf_dsinfer.kernels.quant import INT4_GROUP_SIZES, Int4Weight
from hf_dsinfer.offload import files
from hf_dsinfer.offload.compression import (
    CompressedTensor,
    compress,
    compressed_nbytes,
    decompress,
    packed_nbytes,
)
from hf_dsinfer.offload.packed import PARTS, from_parts, pack_weight
from hf_dsinfer.offload.policy import OffloadPolicy

# Bumped when what a layer file holds changes. A folder written by an older layout (4-bit linears
# as FlexGen codes before the packed int4 layout, under the same slots) was reused by its
# fingerprint and failed deep in the first load with a KeyError. 3: packed 4-bit linears as the
# project's portable Int4Weight (row-major codes, scales, mins), no longer torch's private int4
# layout, whose bytes differ between CPUs (a format-2 folder is rewritten, never misread).
STORE_FORMAT = 3
Source = Callable[[int, str], torch.Tensor]  # (layer index, name in block) -> CPU tensor


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter of a decoder layer and where it lives."""

    name: str  # dotted name inside the block, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    tier: str
    compressed: bool
    packed: bool = False  # 4-bit as a portable Int4Weight, multiplied without dequantizing

    @property
    def dense_nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def buffer_nbytes(self) -> int:
        """Dense bytes this slot occupies in a layer buffer while bound (packed: none)."""
        return 0 if self.packed else self.dense_nbytes

    def stored_nbytes(self, group_size: int) -> int:
        if self.packed:  # codes + scale and min per group in the compute dtype
            return packed_nbytes(_numel(self.shape), group_size, self.dtype.itemsize)
        return compressed_nbytes(_numel(self.shape), group_size) if self.compressed \
            else self.dense_nbytes

    @property
    def bound(self) -> bool:
        """Resident and usable as stored (dense, or packed 4-bit): bound to its module once,
        never loaded per forward."""
        return (self.packed or not self.compressed) and self.tier != "disk"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def split_tiers(numels: list[int], weights: tuple[float, float, float]) -> list[str]:
    """FlexGen's rule: each tensor goes to the tier its byte midpoint falls in."""
    total, running, tiers = max(sum(numels), 1), 0, []
    bounds = (weights[0], weights[0] + weights[1])
    for size in numels:
        middle = 100.0 * (running + size / 2) / total
        running += size
        tiers.append("device" if middle < bounds[0] else "cpu" if middle < bounds[1] else "disk")
    return tiers


def is_compressed(shape: tuple[int, ...], policy: OffloadPolicy) -> bool:
    return policy.compress_weights and len(shape) >= 2 and _numel(shape) % policy.group_size == 0


def is_packed(shape: tuple[int, ...], linear: bool, policy: OffloadPolicy, cpu: bool) -> bool:
    """A compressed nn.Linear weight kept as a portable Int4Weight (groups along its input dim):
    on a CPU compute device a decode step multiplies by its codes directly (PackedInt4Linear)."""
    return (cpu and linear and len(shape) == 2 and is_compressed(shape, policy)
            and policy.group_size in INT4_GROUP_SIZES and shape[1] % policy.group_size == 0)


def linear_weights(block: nn.Module) -> list[bool]:
    """Per parameter of `block` (named_parameters order): is it an nn.Linear's weight?"""
    owners = dict(block.named_modules())
    return [isinstance(owners.get(n.rpartition(".")[0]), nn.Linear) and n.endswith("weight")
            for n, _ in block.named_parameters()]


def place_layer(block: nn.Module, policy: OffloadPolicy, dtype: torch.dtype,
                device: torch.device) -> list[Slot]:
    """FlexGen's per-layer split by cumulative bytes (see the module docstring)."""
    params = [(n, tuple(p.shape)) for n, p in block.named_parameters()]
    tiers = split_tiers([_numel(shape) for _, shape in params], policy.weights)
    cpu = device.type == "cpu"
    slots = []
    for (name, shape), tier, linear in zip(params, tiers, linear_weights(block)):
        if cpu and tier == "device":
            tier = "cpu"  # one RAM: report it as the CPU tier
        slots.append(Slot(name, shape, dtype, tier, is_compressed(shape, policy),
                          is_packed(shape, linear, policy, cpu)))
    return slots


def per_use_dense_bytes(shapes: list[tuple[int, ...]], policy: OffloadPolicy,
                        dtype_bytes: int, linear: list[bool] | None = None,
                        cpu: bool = False) -> int:
    """Dense bytes of one layer's parameters that are loaded per use (disk tier, or 4-bit
    decompressed; packed 4-bit linears need none)."""
    tiers = split_tiers([_numel(s) for s in shapes], policy.weights)
    linear = linear or [False] * len(shapes)
    return sum(_numel(s) * dtype_bytes for s, tier, lin in zip(shapes, tiers, linear)
               if (tier == "disk" or is_compressed(s, policy))
               and not is_packed(s, lin, policy, cpu))


def fingerprint(model_config: dict, slots: list[Slot], num_layers: int, policy: OffloadPolicy,
                source_id: str) -> str:
    """Identity of a disk tier: what was written, from what, in which format."""
    data = {"config": model_config, "layers": num_layers, "group": policy.group_size,
            "source": source_id, "format": STORE_FORMAT,
            "slots": [(s.name, s.shape, str(s.dtype), s.tier, s.compressed, s.packed)
                      for s in slots]}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class WeightStore:
    """The non-bound weights of every decoder layer, per tier; `load(j)` brings one layer back."""

    def __init__(self, slots: list[Slot], num_layers: int, policy: OffloadPolicy,
                 device: torch.device):
        self.slots = slots
        self.num_layers = num_layers
        self.policy = policy
        self.device = device
        self.held: list[dict[str, torch.Tensor | CompressedTensor]] = [
            {} for _ in range(num_layers)]  # device/cpu tier items that are loaded per use
        self.disk: list[files.SafetensorsFile | None] = [None] * num_layers
        self._staging: torch.Tensor | None = None  # pinned read buffer (CUDA only)
        # on the CPU a layer file is read whole, straight into the layer buffer (after its dense
        # part), and its dense tensors are used where they landed
        self.whole_file = device.type == "cpu"
        self._offsets, self.dense_bytes = _buffer_layout(slots, self.whole_file)
        self.file_bytes = 0  # the largest layer file, page-rounded (set by build)
        self.fetch = None  # hf_dsinfer.parallel.fetch.ParallelFetch: reads 1/N, all-gathers
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- building ---------------------------------------------------------------------------------
    def build(self, source: Source, folder: Path | None, fp: str,
              bind: Callable[[int, str, torch.Tensor], None]) -> None:
        """Fill every tier from `source`; the disk tier is reused when `folder` holds a valid
        copy with this fingerprint, else (re)written with a progress bar."""
        disk_slots = [s for s in self.slots if s.tier == "disk"]
        reuse = {}
        if disk_slots:
            reuse = files.open_folder(folder, fp, verify_crc=True)
            if not reuse:
                self._prepare_folder(folder)
        manifest = {}
        for j in tqdm(range(self.num_layers), desc="hf_dsinfer offload: placing layers",
                      disable=self.num_layers < 4 or not disk_slots or bool(reuse)):
            layer_file = self._build_layer(j, source, bind, skip_disk=bool(reuse))
            if layer_file:
                manifest[f"layer_{j:05d}.safetensors"] = files.write_file(
                    folder / f"layer_{j:05d}.safetensors", layer_file)
        if disk_slots and not reuse:
            files.write_manifest(folder, fp, manifest)
            reuse = files.open_folder(folder, fp, verify_crc=False)
        for j in range(self.num_layers if disk_slots else 0):
            self.disk[j] = reuse[f"layer_{j:05d}.safetensors"]
        if self.whole_file and disk_slots:
            span = files.aligned_size if self.fetch is None else self.fetch.span
            self.file_bytes = max(span(f.size) for f in self.disk)

    def _prepare_folder(self, folder: Path) -> None:
        need = self.num_layers * sum(s.stored_nbytes(self.policy.group_size)
                                     for s in self.slots if s.tier == "disk")
        files.check_writable(folder, need)
        (folder / files.MANIFEST).unlink(missing_ok=True)  # never trust a half-rewritten folder

    def _build_layer(self, j: int, source: Source, bind, skip_disk: bool) -> dict:
        to_write: dict[str, torch.Tensor] = {}
        for slot in self.slots:
            if slot.tier == "disk" and skip_disk:
                continue
            tensor = source(j, slot.name).to(slot.dtype)
            if slot.bound and not slot.packed:
                bind(j, slot.name, tensor.to(self.device))
                continue
            item = _compress(tensor, slot, self.policy.group_size)
            if slot.bound:  # packed 4-bit in RAM: multiplied as stored
                bind(j, slot.name, item)
                continue
            if slot.tier == "disk":
                to_write.update(_flatten(slot.name, item))
            else:
                self.held[j][slot.name] = self._keep(item, slot.tier)
        return to_write

    def _keep(self, item, tier: str):
        """A device/cpu tier item in its home memory (pinned host memory for a CUDA device)."""
        if tier == "device":
            return _map(item, lambda t: t.to(self.device))
        if self.device.type == "cuda":
            return _map(item, lambda t: t.pin_memory())
        return item

    # -- loading (runs on the prefetch thread) ----------------------------------------------------
    @property
    def per_use_bytes(self) -> int:
        """Bytes of one layer buffer: dense part, then (CPU) the layer file's span."""
        return self.dense_bytes + self.file_bytes

    def new_buffer(self) -> torch.Tensor:
        """One layer's worth of per-use weights: the engine pools two (current + next), so the
        memory of streamed layers is exactly that, with no allocator growth or fragmentation."""
        if self.whole_file:
            return files.aligned_buffer(self.per_use_bytes)  # O_DIRECT reads land in it
        return torch.empty(self.per_use_bytes, dtype=torch.uint8, device=self.device)

    def load(self, j: int, buffer: torch.Tensor | None = None
             ) -> dict[str, torch.Tensor | Int4Weight]:
        """Compute-device tensors of layer j's non-bound parameters (dense, or packed 4-bit
        Int4Weight codes), as views of `buffer` (from new_buffer(); a fresh one when None)."""
        buffer = self.new_buffer() if buffer is None else buffer
        views = {}
        if self.whole_file and self.disk[j] is not None:
            read = self.disk[j].read_all if self.fetch is None else \
                functools.partial(self.fetch.read_all, self.disk[j])
            views = read(buffer[self.dense_bytes:])
        out = {}
        for slot in self.slots:
            if slot.bound:
                continue
            if slot.packed:  # disk tier: the codes as read
                parts = tuple(views[f"{slot.name}.{p}"] for p in PARTS)
                out[slot.name] = from_parts(parts, self.policy.group_size)
            elif self.whole_file and slot.tier == "disk" and not slot.compressed:
                out[slot.name] = views[slot.name]
            else:
                out[slot.name] = self._load_into_buffer(j, slot, buffer, views)
        if self._stream is not None:
            self._stream.synchronize()  # this layer's copies and decodes are done
        return out

    def _load_into_buffer(self, j: int, slot: Slot, buffer: torch.Tensor,
                          views: dict[str, torch.Tensor]) -> torch.Tensor:
        offset = self._offsets[slot.name]
        dest = buffer[offset: offset + slot.dense_nbytes].view(slot.dtype).view(slot.shape)
        if slot.compressed:
            if slot.tier != "disk":
                item = self.held[j][slot.name]
            elif views:
                parts = [views[f"{slot.name}.{p}"] for p in ("packed", "scales", "mins")]
                item = CompressedTensor(KVInt4(*parts, self.policy.group_size), slot.shape)
            else:
                item = self._read(j, slot)
            decompress(self._to_device(item), slot.dtype, out=dest)
        elif slot.tier == "disk":
            self._read_dense(j, slot, dest)
        else:  # a dense cpu-tier tensor and a CUDA compute device
            self._copy(dest, self.held[j][slot.name])
        return dest

    def _read(self, j: int, slot: Slot) -> CompressedTensor:
        file = self.disk[j]
        parts = [file.read(f"{slot.name}.{p}") for p in ("packed", "scales", "mins")]
        return CompressedTensor(KVInt4(*parts, self.policy.group_size), slot.shape)

    def _read_dense(self, j: int, slot: Slot, dest: torch.Tensor) -> None:
        file = self.disk[j]
        if self.device.type != "cuda":
            file.read(slot.name, dest.view(-1).view(torch.uint8))  # straight into the buffer
            return
        nbytes = file.nbytes(slot.name)
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self._copy(dest, file.read(slot.name, self._staging))
        self._stream.synchronize()  # the pinned staging buffer is reused by the next read

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dest.copy_(src, non_blocking=True)

    def _to_device(self, item):
        if self.device.type != "cuda":
            return item
        with torch.cuda.stream(self._stream):
            return _map(item, lambda t: t.to(self.device, non_blocking=True))

    # -- accounting -------------------------------------------------------------------------------
    def layer_bytes(self, tiers: tuple[str, ...], stored: bool = True) -> int:
        """Bytes of one layer's parameters on `tiers` (as stored, or dense)."""
        g = self.policy.group_size
        return sum(s.stored_nbytes(g) if stored else s.dense_nbytes
                   for s in self.slots if s.tier in tiers)

    def close(self) -> None:
        for file in self.disk:
            if file is not None:
                file.close()


def _buffer_layout(slots: list[Slot], whole_file: bool) -> tuple[dict[str, int], int]:
    """Byte offset of each per-use slot that is decoded or copied into a layer buffer, and the
    size of that dense part (page-rounded, so that the file read after it is aligned). Packed
    slots, and with whole-file reads dense disk slots, are used where the file read put them."""
    offsets, size = {}, 0
    for slot in slots:
        in_file = slot.packed or (whole_file and slot.tier == "disk" and not slot.compressed)
        if not slot.bound and not in_file:
            offsets[slot.name] = size
            size += -(-slot.dense_nbytes // 64) * 64
    return offsets, files.aligned_size(size)


def _compress(tensor: torch.Tensor, slot: Slot, group_size: int):
    if slot.packed:
        return pack_weight(tensor, group_size)
    return compress(tensor, group_size) if slot.compressed else tensor


def _flatten(name: str, item) -> dict[str, torch.Tensor]:
    if isinstance(item, Int4Weight):
        return dict(zip((f"{name}.{p}" for p in PARTS), (item.packed, item.scales, item.mins)))
    if isinstance(item, CompressedTensor):
        codes = item.codes
        return {f"{name}.packed": codes.packed, f"{name}.scales": codes.scales,
                f"{name}.mins": codes.mins}
    return {name: item}


def _map(item, fn):
    if isinstance(item, CompressedTensor):
        codes = item.codes
        return CompressedTensor(type(codes)(fn(codes.packed), fn(codes.scales), fn(codes.mins),
                                            codes.group_size), item.shape)
    return fn(item)
