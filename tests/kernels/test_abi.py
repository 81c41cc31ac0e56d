"""The C interface of the native kernels: kernels/abi.py mirrors csrc/hfd_api.h, and a library
that reports another interface is refused with a clear reason (tests need only a C compiler)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from hf_dsinfer.errors import NativeABIError
from hf_dsinfer.kernels import _native, abi

HEADER = (_native.CSRC / "hfd_api.h").read_text()
CC = shutil.which("gcc") or shutil.which("cc")


def _enum(*names: str) -> dict[str, int]:
    """The values the header gives `names` in its enums (explicit, or counted from 0)."""
    values: dict[str, int] = {}
    for body in re.findall(r"enum\s*\{([^}]*)\}", HEADER):
        at = 0
        for item in (i.strip() for i in body.split(",") if i.strip()):
            name, _, value = (part.strip() for part in item.partition("="))
            at = int(value) if value else at
            values[name] = at
            at += 1
    return {n: values[n] for n in names}


def test_python_mirror_matches_the_header():
    version = re.search(r"#define HFD_ABI_VERSION (\d+)", HEADER)
    assert version and int(version.group(1)) == abi.ABI_VERSION
    assert int(re.search(r"#define HFD_ABI_FIELDS (\d+)", HEADER).group(1)) == len(abi.expected())
    kinds = _enum("LIN_BF16", "LIN_INT8", "LIN_INT4", "LIN_INT8_TILED", "LIN_INT4_TILED")
    assert list(kinds.values()) == [abi.LIN_BF16, abi.LIN_INT8, abi.LIN_INT4,
                                    abi.LIN_INT8_TILED, abi.LIN_INT4_TILED]
    slots = _enum("L_Q", "L_K", "L_V", "L_O", "L_GATE", "L_UP", "L_DOWN", "L_COUNT")
    assert [slots[f"L_{name.upper()}"] for name in abi.SLOTS] == list(range(len(abi.SLOTS)))
    assert slots["L_COUNT"] == len(abi.SLOTS)
    assert _enum("NORM_RMS", "NORM_LAYER") == {"NORM_RMS": abi.NORMS["rms"],
                                               "NORM_LAYER": abi.NORMS["layer"]}
    mlps = _enum(*(f"MLP_{name.upper()}" for name in abi.MLPS))
    assert mlps == {f"MLP_{name.upper()}": code for name, code in abi.MLPS.items()}
    ropes = _enum(*(f"ROPE_{name.upper()}" for name in abi.ROPES))
    assert ropes == {f"ROPE_{name.upper()}": code for name, code in abi.ROPES.items()}
    struct_fields = re.search(r"typedef struct \{(.*?)\} hfd_layer;", HEADER,
                              re.DOTALL).group(1)
    for field, _ in abi.Layer._fields_:
        assert re.search(rf"\b{field}\b", struct_fields), field


@pytest.mark.skipif(not _native.builds(), reason=f"no native library: {_native.why_unavailable()}")
def test_built_library_reports_this_interface():
    lib = _native._load(_native.cpu_tier())
    abi.check(lib, "built")  # no error
    info = (ctypes.c_int64 * 8)()
    assert lib.hfd_abi(info, 8) == len(abi.expected())


def _library(tmp_path, name: str, source: str):
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"lib{name}.so"  # a path of its own: dlopen reuses a loaded path
    subprocess.run([CC, "-shared", "-fPIC", "-O1", f"-I{_native.CSRC}", str(src), "-o",
                    str(out)], check=True, capture_output=True)
    return out


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_mismatched_library_is_refused_with_the_reason(tmp_path, monkeypatch):
    # the real hfd_abi, compiled against a header that claims another version
    stale = _library(tmp_path, "stale", f"#define HFD_ABI_VERSION {abi.ABI_VERSION + 7}\n"
                               '#include <stddef.h>\n#include "hfd_api.h"\n'
                               + re.search(r"int64_t hfd_abi\(int64_t \*info, int64_t n\) \{.*?\n\}",
                                           (_native.CSRC / "cpu_decode.c").read_text(),
                                           re.DOTALL).group(0))
    with pytest.raises(NativeABIError, match=rf"ABI version: library {abi.ABI_VERSION + 7}, "
                                             rf"Python {abi.ABI_VERSION}.*Fix: delete"):
        abi.check(ctypes.CDLL(str(stale)), str(stale))
    old = _library(tmp_path, "old", "int hfd_amx_available(void) { return 0; }\n")
    with pytest.raises(NativeABIError, match="has no hfd_abi"):
        abi.check(ctypes.CDLL(str(old)), str(old))
    # loading refuses it: no library for that tier, and the reason is what why_unavailable says
    monkeypatch.setattr(_native, "build", lambda level, cc=None: stale)
    monkeypatch.setattr(_native, "_why", {})
    assert _native._load.__wrapped__("generic") is None
    assert "does not match hf_dsinfer's C interface" in _native._why["generic"]
