"""Safetensors files of the disk tier: written once, atomically; validated before they are used;
read with positioned reads straight into the destination buffer.

Format: standard safetensors (8-byte little-endian header length, JSON header, raw data), so any
safetensors tool can inspect the offload folder. A folder is trusted only through its
`manifest.json`, written last (after every file is fsync'ed and renamed into place), which
records each file's size and CRC-32. Opening a folder checks that every listed file exists, has
its recorded size, has a parseable header whose tensors lie inside the file, and (when asked)
that its CRC-32 matches: a truncated or corrupted file is refused with `OffloadFileError` before
any generation starts.

Reads use `os.preadv` into a torch buffer rather than an mmap: the bytes land directly in the
(pinned, on GPU) destination, the GIL is released during the read so the prefetch thread
overlaps compute, and no file pages are mapped into the process (an mmap's touched pages count
in its RSS, which the memory budget promises to bound). After a read the pages are dropped from
the page cache (`POSIX_FADV_DONTNEED`), so the disk tier is really read from disk every time.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_dsinfer.errors import OffloadFileError

MANIFEST = "manifest.json"
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_CRC_CHUNK = 64 << 20
DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in whole pages



# -- writing ---------------------------------------------------------------------------------------
def check_writable(folder: Path, need_bytes: int = 0) -> None:
    """Create `folder` and prove it takes a file and has room for `need_bytes`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise OffloadFileError(
            f"offload_dir {str(folder)!r} is not writable: {err.strerror or err}. Expected a "
            "folder this process can create files in. Fix: pass offload_dir= a writable local "
            "folder with free space (e.g. under /tmp), or fix its permissions.") from None
    free = _free_bytes(folder)
    if need_bytes and free < need_bytes:
        raise OffloadFileError(
            f"offload_dir {str(folder)!r} has {free / 2**30:.2f} GiB free, the disk tier needs "
            f"{need_bytes / 2**30:.2f} GiB. Fix: free space there, pick another offload_dir, or "
            "put a smaller share on disk (weights=(…, …, smaller) or compress_weights=True).")


def _free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write a safetensors file atomically (temp name, fsync, rename); return its manifest entry."""
    tmp = path.with_name(path.name + ".partial")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return {"size": path.stat().st_size, "crc32": file_crc32(path)}


def write_manifest(folder: Path, fingerprint: str, files: dict[str, dict]) -> None:
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps({"version": 1, "fingerprint": fingerprint, "files": files}))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    _drop_cache(path)
    return crc


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- reading / validation --------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when there is none (never written, or interrupted)."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise OffloadFileError(
            f"{folder / MANIFEST}: unreadable offload manifest ({err}). Fix: delete the folder "
            f"{str(folder)!r}; it is rewritten on the next load.") from None


class SafetensorsFile:
    """One validated safetensors file, read by name into fresh (or given) buffers."""

    def __init__(self, path: Path, expected: dict | None = None, verify_crc: bool = False):
        self.path = path
        self._fd = -1
        self.entries, self.data_start = self._validate(expected, verify_crc)
        self._fd = os.open(path, os.O_RDONLY)
        self._direct = hasattr(os, "O_DIRECT")  # until a direct read is refused

    def _fail(self, what: str) -> OffloadFileError:
        return OffloadFileError(
            f"offload file {str(self.path)!r} is {what}. It is refused before generation. Fix: "
            f"delete the folder {str(self.path.parent)!r}; it is rewritten from the checkpoint "
            "on the next load.")

    def _validate(self, expected: dict | None, verify_crc: bool):
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise self._fail("missing") from None
        if expected is not None and size != expected["size"]:
            raise self._fail(f"truncated or overwritten: expected {expected['size']} bytes, got "
                             f"{size}")
        entries, start = self._header(size)
        if verify_crc and expected is not None and file_crc32(self.path) != expected["crc32"]:
            raise self._fail("corrupted: its CRC-32 does not match the manifest")
        return entries, start

    def _header(self, size: int):
        with open(self.path, "rb") as handle:
            raw = handle.read(8)
            length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < length <= size - 8:
                raise self._fail("not a safetensors file (bad header length)")
            try:
                header = json.loads(handle.read(length))
            except ValueError:
                raise self._fail("not a safetensors file (corrupted header)") from None
        header.pop("__metadata__", None)
        start = 8 + length
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            if info["dtype"] not in _ST_DTYPES or hi > size - start or lo > hi:
                raise self._fail(f"inconsistent: tensor {name!r} lies outside the file")
        return header, start

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`, read into `out` (a uint8 buffer of at least its size) or a new one."""
        info = self.entries[name]
        lo, hi = info["data_offsets"]
        buf = torch.empty(hi - lo, dtype=torch.uint8) if out is None else out[: hi - lo]
        if hi > lo:
            got = os.preadv(self._fd, [buf.numpy()], self.data_start + lo)
            if got != hi - lo:
                raise self._fail(f"short: read {got} of {hi - lo} bytes of {name!r}")
            os.posix_fadvise(self._fd, self.data_start + lo, hi - lo, os.POSIX_FADV_DONTNEED)
        return buf.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])

    @property
    def size(self) -> int:
        """Bytes of the whole file (header + data)."""
        return self.data_start + max((e["data_offsets"][1] for e in self.entries.values()),
                                     default=0)

    def read_all(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor of the file, as views of `out` (a uint8 buffer of at least
        `aligned_size(self.size)` bytes whose address is DIRECT_ALIGN-aligned), filled by one
        whole-file read: O_DIRECT where the file system allows it (DMA into the buffer, no page
        cache, no copy on the CPU; steadier than buffered reads while the CPU is busy:
        docs/performance.md, "Behind the code"), else one buffered read."""
        size = self.size
        span = aligned_size(size)
        assert out.numel() >= span and out.data_ptr() % DIRECT_ALIGN == 0, "unaligned buffer"
        got = _read_direct(self.path, out[:span]) if self._direct else -1
        if got < 0:
            self._direct = False
            got = os.preadv(self._fd, [out[:size].numpy()], 0)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if got < size:
            raise self._fail(f"short: read {got} of {size} bytes")
        return self.views(out)

    def read_span(self, out: torch.Tensor, start: int) -> int:
        """Bytes [start, start + len(out)) of the file into `out` (one buffered read)."""
        got = os.preadv(self._fd, [out.numpy()], start)
        os.posix_fadvise(self._fd, start, out.numel(), os.POSIX_FADV_DONTNEED)
        if got != out.numel():
            raise self._fail(f"short: read {got} of {out.numel()} bytes at {start}")
        return got

    def views(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor of the file as a view of `out`, which holds the whole file's bytes."""
        views = {}
        for name, info in self.entries.items():
            lo, hi = info["data_offsets"]
            raw = out[self.data_start + lo: self.data_start + hi]
            views[name] = raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
        return views

    def nbytes(self, name: str) -> int:
        lo, hi = self.entries[name]["data_offsets"]
        return hi - lo

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def aligned_size(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer of `nbytes` whose address is DIRECT_ALIGN-aligned (O_DIRECT needs
    it; torch's allocator aligns to 64 bytes only)."""
    return aligned_view(torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8), nbytes,
                        DIRECT_ALIGN)


def aligned_view(raw: torch.Tensor, nbytes: int, align: int) -> torch.Tensor:
    """The first `nbytes` of uint8 `raw` (at least nbytes + align - 1 long) that start at an
    address multiple of `align`."""
    skip = -raw.data_ptr() % align
    return raw[skip: skip + nbytes]


def _read_direct(path: Path, out: torch.Tensor) -> int:
    """Bytes read by one O_DIRECT read of `path` from offset 0 into `out`, or -1 where the file
    system refuses O_DIRECT (tmpfs, some overlay mounts)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return -1
    try:
        return os.preadv(fd, [out.numpy()], 0)
    except OSError:
        return -1
    finally:
        os.close(fd)


def open_folder(folder: Path, fingerprint: str, verify_crc: bool) -> dict[str, SafetensorsFile]:
    """Every file of a written folder, validated; {} when the folder holds no usable manifest
    for this fingerprint (then it is to be (re)written)."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return {}
    return {name: SafetensorsFile(folder / name, entry, verify_crc)
            for name, entry in manifest["files"].items()}
