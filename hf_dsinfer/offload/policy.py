"""OffloadPolicy: where weights, KV cache and activations live, in FlexGen's vocabulary.

FlexGen describes a placement by percentages on three tiers and a block of micro-batches:

    weights      (device %, cpu %, disk %)   split inside every decoder layer, per tensor, by
                                             cumulative bytes; the same split for every layer
    cache        (device %, cpu %, disk %)   KV cache, split by sequences of each micro-batch
    activations  (device %, cpu %, disk %)   hidden states between layers (whole tiers only)
    micro_batch_size x num_micro_batches      FlexGen's gpu_batch_size x num_gpu_batches: the
                                             block that shares one read of each layer's weights
    overlap, cpu_attention, compress_weights, compress_cache (4-bit group-wise, min-max)

"device" is the compute device: CUDA when present, otherwise the CPU, whose two memory tiers
("device" and "cpu") are then the same RAM and only "disk" is a separate tier.

`memory` (host RAM) and `device_memory` (GPU memory) are budgets: the engine checks at load,
before anything is written, that the policy fits them, and the planner (`plan`) chooses a
policy under them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hf_dsinfer.errors import DSInferConfigError

TIERS = ("device", "cpu", "disk")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, name: str) -> int | None:
    """None, an int of bytes, or a string like "2.5GiB" / "800MB" -> bytes."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, float) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, str) and match and match.group(2).lower() in _UNITS:
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
        if size > 0:
            return size
    raise DSInferConfigError(
        f"OffloadPolicy.{name}: expected a positive number of bytes or a size string like "
        f"'2.5GiB' / '800MB', got {value!r}. Fix: {name}='2GiB'."
    )


def format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def _percentages(value: Any, name: str) -> tuple[float, float, float]:
    """Validate a (device, cpu, disk) triple of non-negative percentages summing to 100."""
    fix = f"Fix: {name}=(0, 60, 40) puts 60% on the CPU and 40% on disk."
    if isinstance(value, dict):
        unknown = set(value) - set(TIERS)
        if unknown:
            raise DSInferConfigError(
                f"OffloadPolicy.{name}: unknown tier(s) {sorted(unknown)}; tiers are {TIERS}. {fix}")
        value = tuple(value.get(t, 0) for t in TIERS)
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value):
        raise DSInferConfigError(
            f"OffloadPolicy.{name}: expected three non-negative percentages (device, cpu, disk), "
            f"got {value!r}. {fix}")
    if abs(sum(value) - 100.0) > 1e-6:
        raise DSInferConfigError(
            f"OffloadPolicy.{name}: the percentages (device, cpu, disk) must sum to 100, got "
            f"{tuple(value)} (sum {sum(value):g}). {fix}")
    return tuple(float(v) for v in value)


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise DSInferConfigError(
            f"OffloadPolicy.{name}: expected True or False, got {value!r}. Fix: {name}=True.")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DSInferConfigError(
            f"OffloadPolicy.{name}: expected a positive int, got {value!r}. Fix: {name}=1.")


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Placement and schedule of an offloaded model (see the module docstring).

    Attributes:
        weights / cache / activations: (device %, cpu %, disk %), each summing to 100.
            Activations must sit whole on one memory tier: (100, 0, 0) or (0, 100, 0).
        micro_batch_size: sequences per micro-batch (FlexGen's gpu_batch_size).
        num_micro_batches: micro-batches per block (FlexGen's num_gpu_batches); a generate()
            batch larger than the block runs block after block.
        overlap: prefetch layer j+1's weights and micro-batch k+1's cache while (j, k) computes.
        cpu_attention: FlexGen's CPU delegation of attention. On a CPU compute device
            attention always runs on the CPU where the cache is; on a CUDA compute device it is
            not implemented yet and is refused at load (the cache is prefetched to the GPU).
        compress_weights / compress_cache: 4-bit group-wise min-max compression (FlexGen) of the
            offloaded block weights (tensors whose size is a multiple of `group_size`) and of
            the KV cache (groups along head_dim).
        group_size: compression group length (FlexGen: 64). For the cache it must divide the
            head dim; a cache whose head dim it does not divide is refused at load.
        offload_dir: folder for the disk tier (weights written once, KV files per generate);
            required when any percentage is on disk.
        memory: host-RAM budget of the offloaded model (bytes or '2.5GiB'), checked at load.
        device_memory: GPU-memory budget when the compute device is CUDA.
        device: compute device ('cpu', 'cuda', 'cuda:1'); None picks CUDA when available.
        parallel_fetch: ZeRO-Inference's parallel fetch, under torch.distributed with N > 1
            processes that all run the same generate calls: each rank reads 1/N of every
            layer's disk file and the ranks all-gather the rest (hf_dsinfer.parallel.fetch), so
            their read bandwidths add up. Disk tier, CPU compute device.
    """

    weights: tuple[float, float, float] = (0.0, 100.0, 0.0)
    cache: tuple[float, float, float] = (0.0, 100.0, 0.0)
    activations: tuple[float, float, float] = (100.0, 0.0, 0.0)
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    overlap: bool = True
    cpu_attention: bool = False
    compress_weights: bool = False
    compress_cache: bool = False
    group_size: int = 64
    offload_dir: str | None = None
    memory: int | None = None
    device_memory: int | None = None
    device: str | None = None
    parallel_fetch: bool = False

    def __post_init__(self) -> None:
        for name in ("weights", "cache", "activations"):
            object.__setattr__(self, name, _percentages(getattr(self, name), name))
        for name in ("micro_batch_size", "num_micro_batches"):
            _check_positive_int(name, getattr(self, name))
        for name in ("overlap", "cpu_attention", "compress_weights", "compress_cache",
                     "parallel_fetch"):
            _check_flag(name, getattr(self, name))
        for name in ("memory", "device_memory"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        self._check_group_size()
        self._check_activations()
        self._check_disk()
        if self.device is not None and not isinstance(self.device, str):
            raise DSInferConfigError(
                f"OffloadPolicy.device: expected None, 'cpu' or 'cuda[:N]', got {self.device!r}. "
                "Fix: leave it out to use CUDA when present.")

    def _check_group_size(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or (
                self.group_size < 2 or self.group_size % 2):
            raise DSInferConfigError(
                f"OffloadPolicy.group_size: expected an even int >= 2, got {self.group_size!r}. "
                "Fix: group_size=64 (FlexGen's choice).")

    def _check_activations(self) -> None:
        if self.activations not in ((100.0, 0.0, 0.0), (0.0, 100.0, 0.0)):
            raise DSInferConfigError(
                f"OffloadPolicy.activations: hidden states live whole on one memory tier, got "
                f"{self.activations}. Fix: activations=(100, 0, 0) (compute device) or "
                "(0, 100, 0) (CPU); activations on disk are not supported (they are a few MB "
                "per micro-batch and are rewritten every layer).")

    def _check_disk(self) -> None:
        on_disk = [n for n in ("weights", "cache") if getattr(self, n)[2] > 0]
        if on_disk and not self.offload_dir:
            raise DSInferConfigError(
                f"OffloadPolicy: {' and '.join(on_disk)}: a disk share is set but offload_dir is "
                "not set. Fix: offload_dir='/path/with/space' (a local disk; it is written "
                "once and reused).")
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            raise DSInferConfigError(
                f"OffloadPolicy.offload_dir: expected a path string, got {self.offload_dir!r}. "
                "Fix: offload_dir=str(path).")

    # -- derived --------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    def describe(self) -> str:
        def tiers(p: tuple[float, float, float]) -> str:
            return "/".join(f"{v:g}" for v in p)

        flags = [n for n in ("overlap", "cpu_attention", "compress_weights", "compress_cache")
                 if getattr(self, n)]
        return (f"weights {tiers(self.weights)} | cache {tiers(self.cache)} | activations "
                f"{tiers(self.activations)} (% device/cpu/disk) | block "
                f"{self.micro_batch_size} x {self.num_micro_batches} | "
                f"{', '.join(flags) or 'no overlap, no compression'}")

    # -- construction / serialisation -----------------------------------------------------------
    @classmethod
    def coerce(cls, value: Any) -> OffloadPolicy | None:
        """None, an OffloadPolicy or a dict of its fields -> OffloadPolicy (or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = [k for k in value if k not in names]
            if unknown:
                import difflib

                close = difflib.get_close_matches(str(unknown[0]), names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise DSInferConfigError(
                    f"DSInferConfig.offload: unknown key {unknown[0]!r}.{hint} "
                    f"Valid keys: {names}.")
            return cls(**value)
        raise DSInferConfigError(
            f"DSInferConfig.offload: expected None, a dict or an OffloadPolicy, got {value!r}. "
            "Fix: offload={'weights': (0, 50, 50), 'offload_dir': '/tmp/offload'}.")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("weights", "cache", "activations"):
            data[name] = list(data[name])
        return data

    def replace(self, **overrides: Any) -> OffloadPolicy:
        return dataclasses.replace(self, **overrides)
