"""The C interface of the native kernels (csrc/hfd_api.h), mirrored for ctypes in one place.

The structs, the constant sets and ABI_VERSION below are what hfd_api.h declares; a test
(tests/kernels/test_abi.py) parses the header and compares. At load, `check` asks the library
(`hfd_abi`) for its version and struct layout and refuses a library that does not match: a
stale build, or one compiled from other sources, would otherwise read the structs wrong.
"""

from __future__ import annotations

import ctypes

from hf_dsinfer.errors import NativeABIError

ABI_VERSION = 9  # hfd_api.h: HFD_ABI_VERSION (9: a residual multiplier after post-norms)

# Kinds of linear (hfd_api.h: LIN_*); the _TILED ones store their weight as row tiles.
LIN_BF16, LIN_INT8, LIN_INT4, LIN_INT8_TILED, LIN_INT4_TILED = 0, 1, 2, 3, 4
# 4-bit codes times 8-bit activations (quant act_bits=8), in hfd_int4_gemm_a8's numbers (ABI 6)
LIN_INT4_A8, LIN_INT4_A8_TILED = 5, 6
# The linears of one layer, by name (hfd_api.h: L_Q .. L_DOWN). OPT's ReLU MLP puts fc1 in
# "gate", leaves "up" empty and fc2 in "down".
SLOTS = ("q", "k", "v", "o", "gate", "up", "down")
# hfd_api.h: NORM_*, by the policies' norm names (injection/policy.py: RMS, "layer", RMS_FP32,
# RMS_UNIT_OFFSET): the RMSNorm numerics of every norm of a layer
NORMS = {"rms": 0, "layer": 1, "rms_fp32": 2, "rms_unit_offset": 3}
# hfd_api.h: MLP_*; the plain (ungated) ones read fc1 in the gate slot, no up (relu2 and
# gelu_tanh: ABI 8)
MLPS = {"gated_silu": 0, "relu": 1, "gated_gelu_tanh": 2, "relu2": 3, "gelu_tanh": 4}
MLPS_PLAIN = ("relu", "relu2", "gelu_tanh")
# hfd_api.h: ROPE_*, by the dtype of cos / sin and the rotation: rotate-half, or interleaved
# pairs read from the first half of Llama's tables (ABI 7)
ROPES = {"none": 0, "bf16": 1, "fp32": 2, "bf16_pairs": 3, "fp32_pairs": 4}
ROPES_FP32 = ("fp32", "fp32_pairs")


class Lin(ctypes.Structure):
    """hfd_lin: one linear layer as the model stores it."""

    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("group", ctypes.c_int64), ("s_dt", ctypes.c_int64), ("b_dt", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("in_scale", ctypes.c_void_p), ("rowsum", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """hfd_layer: one decoder layer. Its linears are addressed by name: `layer.lin[slot("o")]`."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("scale", ctypes.c_float), ("q_scale", ctypes.c_float),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("ln1_b", ctypes.c_void_p), ("ln2_b", ctypes.c_void_p),
                ("norm", ctypes.c_int64), ("rope", ctypes.c_int64), ("mlp", ctypes.c_int64),
                ("lin", Lin * len(SLOTS)), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("q_eps", ctypes.c_float),
                ("k_eps", ctypes.c_float), ("resid_mult", ctypes.c_float),
                # ABI 2
                ("ln3", ctypes.c_void_p), ("ln4", ctypes.c_void_p), ("eps3", ctypes.c_float),
                ("eps4", ctypes.c_float), ("softcap", ctypes.c_float),
                ("window", ctypes.c_int64), ("qk_norm_full", ctypes.c_int64),
                # ABI 3
                ("rotary_dim", ctypes.c_int64),
                # ABI 7
                ("qk_norm_after_rope", ctypes.c_int64)]


class KVSpan(ctypes.Structure):
    """hfd_kv_span: consecutive tokens of a token-major 4-bit KV cache."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("kp", "ks", "km", "vp", "vs", "vm")] + [
        (name, ctypes.c_int64) for name in ("p_stride", "s_stride", "tokens")]


def slot(name: str) -> int:
    """The index of a named linear in hfd_layer.lin."""
    return SLOTS.index(name)


def expected() -> tuple[int, ...]:
    """What hfd_abi() must report, in its order (hfd_api.h)."""
    return (ABI_VERSION, ctypes.sizeof(Lin), ctypes.sizeof(Layer), len(SLOTS),
            Layer.lin.offset, Layer.resid_mult.offset, ctypes.sizeof(KVSpan))


_FIELDS = ("ABI version", "sizeof(hfd_lin)", "sizeof(hfd_layer)", "L_COUNT",
           "offsetof(hfd_layer, lin)", "offsetof(hfd_layer, resid_mult)", "sizeof(hfd_kv_span)")


def check(lib: ctypes.CDLL, path: str) -> None:
    """Raise NativeABIError unless the library at `path` speaks this module's interface."""
    fix = ("Fix: delete that file (it is rebuilt from the installed sources on next use), or "
           "reinstall hf_dsinfer so its Python and C sources match.")
    try:
        fn = lib.hfd_abi
    except AttributeError:
        raise NativeABIError(f"native library {path} has no hfd_abi(): built from sources older "
                             f"than ABI version {ABI_VERSION}. {fix}") from None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
    want = expected()
    info = (ctypes.c_int64 * len(want))()
    got = tuple(info[: fn(info, len(want))])
    if got != want:
        diff = "; ".join(f"{name}: library {g}, Python {w}" for name, g, w
                         in zip(_FIELDS, got + (None,) * len(want), want) if g != w)
        raise NativeABIError(f"native library {path} does not match hf_dsinfer's C interface "
                             f"({diff}). {fix}")
