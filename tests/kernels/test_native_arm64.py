"""The native kernels on ARM64: the generic tier cross-compiled for aarch64 and run under
qemu-aarch64 user-mode emulation.

The kernels are written with AVX-512 intrinsics; for aarch64 SIMDe maps them to NEON (gcc's
aarch64 target always has Advanced SIMD and FMA), so the generic tier built by
`aarch64-linux-gnu-gcc` is in effect a NEON build. tests/kernels/native_driver.c runs the
library's exported functions (csrc/hfd_api.h: int8 GEMV and its dequantization, row-major and
tiled; the int4 linear and dequantization, row-major and tiled; 4-bit KV codes, their decoding and
the attention over them; the MoE expert MLPs; the decode layer's two calls for Llama bf16, Llama
with every quantized weight kind, and OPT; the whole-step loop) on fixed inputs and writes inputs
and outputs; the AMX kernels (hfd_linear_bf16, hfd_int8_amx, the batched layer built on them)
exist only in the amx tier and are not run. The same driver is built three times:

    aarch64 generic (under qemu) == host generic == host best tier, to the bit
    each of them                 == torch references (exactly where the kernel promises torch's
                                    bits: dequantization, KV codes; within the tolerances below
                                    where it sums in another order)

The tiers promise the same numbers (csrc/hfd_simd.h), so every output is compared to the bit.
The bf16 Llama layer is also checked against HF's bf16 ops (q, k, v, the output); the quantized
and OPT layers against the same bits on every build, and the one-call loop against the two
calls (their agreement with HF is tested at every tier by test_native_decode.py).

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: apt-get install gcc-aarch64-linux-gnu
qemu-user); where they are missing the aarch64 test skips and says so. The host comparisons
need only gcc. About 45 s with nothing cached (three builds of the library), 6 s after.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import kv_quant as KV
from hf_dsinfer.kernels import quant as Q

DRIVER = Path(__file__).with_name("native_driver.c")
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's aarch64 libc, libgomp, loader
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.uint8, 4: torch.int8,
          5: torch.int32}

pytestmark = pytest.mark.skipif(not _native.builds(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")


def _missing_cross_tools() -> str | None:
    missing = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    if not (SYSROOT / "lib" / "libgomp.so.1").exists():
        missing.append(f"{SYSROOT}/lib/libgomp.so.1")
    if missing:
        return (f"no {', '.join(missing)}: apt-get install gcc-aarch64-linux-gnu qemu-user "
                "to run the aarch64 build")
    return None


def _records(path: Path) -> dict[str, torch.Tensor]:
    """The driver's output file: name -> tensor (see native_driver.c for the format)."""
    data, at, out = path.read_bytes(), 0, {}
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at)
        name = data[at + 4: at + 4 + length].decode()
        at += 4 + length
        code, ndim = struct.unpack_from("<II", data, at)
        dims = struct.unpack_from(f"<{ndim}q", data, at + 8)
        at += 8 + 8 * ndim
        dtype = DTYPES[code]
        count = int(torch.Size(dims).numel())
        nbytes = count * dtype.itemsize
        out[name] = torch.frombuffer(bytearray(data[at: at + nbytes]), dtype=dtype).reshape(dims)
        at += nbytes
    return out


def _run_driver(cc: str, tier: str, workdir: Path, emulate: bool = False) -> dict:
    """Build the driver with `cc` against the library of `tier` built by the same compiler,
    run it (under qemu-aarch64 when `emulate`), and read what it wrote."""
    library = _native.build(tier, cc)
    exe, out = workdir / f"driver-{tier}", workdir / f"out-{tier}.bin"
    subprocess.run([cc, "-O1", "-I", str(_native.CSRC), str(DRIVER), "-L", str(library.parent),
                    "-lhfd_cpu", f"-Wl,-rpath,{library.parent}", "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    cmd = [QEMU, "-L", str(SYSROOT), str(exe), str(out)] if emulate else [str(exe), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, f"driver failed ({run.returncode}): {run.stderr[-2000:]}"
    return _records(out)


@pytest.fixture(scope="module")
def host_generic(tmp_path_factory) -> dict:
    cc = _native.compiler()
    return _run_driver(cc, "generic", tmp_path_factory.mktemp("host_generic"))


def _assert_same_bits(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    differ = [f"{name} (max |diff| {(got[name].double() - want[name].double()).abs().max():.3g})"
              for name in want if not torch.equal(got[name].view(torch.uint8).flatten(),
                                                  want[name].view(torch.uint8).flatten())]
    assert not differ, f"{what} differs in: {', '.join(differ)}"


def test_best_tier_equals_generic(host_generic, tmp_path):
    """The driver's outputs at this CPU's best tier (AMX is not used by the calls it makes) are
    those of the generic tier, to the bit."""
    best = _native.cpu_tier()
    if best == "generic":
        pytest.skip("this CPU's best tier is generic: nothing to compare with")
    got = _run_driver(_native.compiler(), best, tmp_path)
    _assert_same_bits(got, host_generic, f"the {best} tier")


def test_aarch64_equals_host(host_generic, tmp_path):
    """The aarch64 (NEON) build under qemu computes what the host's generic tier computes, to
    the bit, and matches the references."""
    reason = _missing_cross_tools()
    if reason:
        pytest.skip(reason)
    got = _run_driver(CROSS_CC, "generic", tmp_path, emulate=True)
    _check_references(got)
    _assert_same_bits(got, host_generic, "the aarch64 build")


def test_host_generic_matches_references(host_generic):
    _check_references(host_generic)


# ---- references: torch's ops on the inputs the driver recorded ----

def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """|got - want| <= rtol * max|want| elementwise (sums in another order, roundings)."""
    err = (got.double() - want.double()).abs().max().item()
    bound = rtol * want.double().abs().max().item()
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"
    assert want.abs().max() > 0, f"{what}: reference is all zeros (the case tests nothing)"


def _check_references(r: dict) -> None:
    _check_int8(r)
    for name in ("int4", "int4t"):
        _check_int4(r, name)
    _check_kv(r)
    _check_moe(r)
    _check_decode(r)


def _check_int8(r: dict) -> None:
    w = Q.Int8Weight(r["int8.q"], r["int8.scales"], r["int8.in_scale"])
    want = F.linear(r["int8.x"].double(), Q.dequantize_int8(w, torch.float32).double(),
                    r["int8.bias"].double())
    _close(r["int8.y"], want, 2 ** -7, "int8 GEMV (bf16 out)")
    rows = Q.Int8Weight(w.qweight[4:20], w.scales[4:20], w.in_scale)
    assert torch.equal(r["int8.rows4_20"], Q.dequantize_int8(rows, torch.bfloat16))
    wt = Q.Int8Weight(r["int8t.q"], r["int8t.scales"])
    want = r["int8t.x"].double() @ Q.dequantize_int8(wt, torch.float32).double().T
    _close(r["int8t.y"], want, 1e-5, "int8 GEMV, tiled (fp32 out)")
    assert torch.equal(r["int8t.rows"], Q.dequantize_int8(wt, torch.float32))


def _check_int4(r: dict, name: str) -> None:
    codes, scales = r[f"{name}.codes"], r[f"{name}.scales"]
    n, half = codes.shape
    group = 2 * half // scales.shape[1]
    tiled = name.endswith("t")
    if tiled:  # the driver's random bytes are the tiles [n / 4, K / 128, 4, 64]
        codes = codes.reshape(n // 4, half // 64, 4, 64)
    w = Q.Int4Weight(codes, scales, r[f"{name}.mins"], group, False, tiled=tiled)
    assert torch.equal(r[f"{name}.rows"], Q.dequantize_int4(w, torch.bfloat16))
    want = r[f"{name}.x"].double() @ Q.dequantize_int4(w, torch.float32).double().T
    _close(r[f"{name}.y"], want, 1e-5, f"int4 linear {name}")


def _check_kv(r: dict) -> None:
    for t in "kv":
        kv = KV.quantize_kv_int4_ref(r[f"kv.{t}"], 32)
        assert torch.equal(r[f"kv.{t}_codes"], kv.packed)
        assert torch.equal(r[f"kv.{t}_scales"], kv.scales)
        assert torch.equal(r[f"kv.{t}_mins"], kv.mins)
    k = KV.dequantize_kv_int4_ref(KV.KVInt4(r["kv.k_codes"], r["kv.k_scales"], r["kv.k_mins"],
                                            32), torch.float32)  # [T, U, D]
    v = KV.dequantize_kv_int4_ref(KV.KVInt4(r["kv.v_codes"], r["kv.v_scales"], r["kv.v_mins"],
                                            32), torch.float32)
    assert torch.equal(r["kv.k_decoded"], k.transpose(0, 1))
    q, keep = r["kv.q"].double(), r["kv.keep"].bool()  # [R, H, D], [R, T]
    rows, heads = q.shape[:2]
    units = k.shape[1] // rows  # kv heads per row
    k = k.double().unflatten(1, (rows, units)).repeat_interleave(heads // units, dim=2)
    v = v.double().unflatten(1, (rows, units)).repeat_interleave(heads // units, dim=2)
    scores = torch.einsum("rhd,trhd->rht", q, k) * 0.125
    p = scores.masked_fill(~keep[:, None, :], float("-inf")).softmax(-1)
    want = torch.einsum("rht,trhd->rhd", p, v)
    # probabilities rounded to bf16 before they weight V (torch's CPU flash attention does)
    _close(r["kv.out"], want, 2 ** -7, "attention over KV codes")


def _check_moe(r: dict) -> None:
    x, gate_up, down = r["moe.x"], r["moe.gate_up"], r["moe.down"]
    offsets, inter = r["moe.offsets"].tolist(), down.shape[2]
    want = torch.zeros_like(r["moe.y"], dtype=torch.float64)
    for e in range(len(offsets) - 1):
        xe = x[offsets[e]:offsets[e + 1]].float()
        g = (xe @ gate_up[e, :inter].float().T).bfloat16()
        u = (xe @ gate_up[e, inter:].float().T).bfloat16()
        a = (F.silu(g.float()).bfloat16().float() * u.float()).bfloat16()
        want[offsets[e]:offsets[e + 1]] = (a.float() @ down[e].float().T).bfloat16().double()
    _close(r["moe.y"], want, 2 ** -6, "MoE experts")
    weighted = (want.bfloat16().float() * r["moe.rw"][:, None]).bfloat16()
    _close(r["moe.y_weighted"], weighted, 2 ** -6, "MoE experts, routing weights")


def _check_decode(r: dict) -> None:
    assert torch.equal(r["decode.layers_out"], r["decode.two_calls_out"]), (
        "hfd_decode_layers differs from the layers' two calls")
    for name in ("llama_bf16", "llama_quant", "opt_bf16"):
        out = r[f"{name}.out"].float()
        assert out.isfinite().all() and out.abs().max() > 0, f"{name}: output {out}"
    q, k, v, out = _llama_layer_ref(r, "llama_bf16")
    heads_k = r["llama_bf16.kc"].shape[0]
    assert torch.equal(r["llama_bf16.kc"][:, 4], r["llama_bf16.k"].view(heads_k, -1))
    for what, want in (("q", q), ("k", k), ("v", v)):  # a projection's fp32 sum, rounded once
        _close(r[f"llama_bf16.{what}"], want.flatten(), 2 ** -7, f"decode layer {what}")
    # bf16 roundings at HF's points, sums in other orders: two bf16 ulps of the largest value
    # (one here; the layer without its keep mask is 40 ulps away)
    _close(r["llama_bf16.out"], out, 2 ** -7, "decode layer output")


def _rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm on bf16 (eps 1e-5, as the driver's layers)."""
    v32 = v.float()
    return w * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on bf16 [heads, d]."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _llama_layer_ref(r: dict, p: str):
    """q, k, v and the output of the driver's bf16 Llama layer, as HF's bf16 modules compute
    them; attention over the cache the step wrote its key and value into (token 4)."""
    x, cos, sin, keep = r["decode.x"], r["decode.cos"], r["decode.sin"], r["decode.keep"].bool()
    d = cos.shape[0]

    def lin(h, name):
        return (h.float() @ r[f"{p}.w_{name}"].float().T).bfloat16()

    h = _rms(x, r[f"{p}.ln1"])
    q = _rotate(lin(h, "q").view(-1, d), cos, sin)  # [heads, d]
    k = _rotate(lin(h, "k").view(-1, d), cos, sin)  # [kv_heads, d]
    v = lin(h, "v")
    tokens = keep.shape[0]
    rep = q.shape[0] // k.shape[0]
    kc = r[f"{p}.kc"][:, :tokens].float().repeat_interleave(rep, 0)  # [heads, tokens, d]
    vc = r[f"{p}.vc"][:, :tokens].float().repeat_interleave(rep, 0)
    scores = torch.einsum("hd,htd->ht", q.float(), kc) * d ** -0.5
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    a = torch.einsum("ht,htd->hd", probs, vc).bfloat16().flatten()
    x1 = x + lin(a, "o")
    h2 = _rms(x1, r[f"{p}.ln2"])
    act = F.silu(lin(h2, "gate")) * lin(h2, "up")
    return q, k, v, x1 + lin(act, "down")
