"""Every ISA tier of the native kernels computes the same numbers (csrc/hfd_simd.h).

Each case runs at every tier this CPU has (HF_DSINFER_ISA caps the tier; the library of each tier
is built once) and is compared with the CPU's best tier to the bit. AMX is switched off for the
comparison: AMX tiles sum in another order than the vector kernels (that difference is tested
against references in test_native*.py).
"""

from __future__ import annotations

import pytest
import torch
from switches import switch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import hf_dsinfer
from hf_dsinfer import settings
from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels import attention as A
from hf_dsinfer.kernels import kv_quant as KV
from hf_dsinfer.kernels import moe as M
from hf_dsinfer.kernels import quant as Q

pytestmark = pytest.mark.skipif(not _native.builds(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")

BEST = _native.cpu_tier()
LOWER = _native.runnable_tiers()[:-1]


def _at(monkeypatch, tier: str, fn):
    """fn() with the kernels capped at `tier`, dispatching on the best tier's row counts
    (kernels/crossovers.py): the same kernels run, whatever each tier's crossovers are."""
    with monkeypatch.context() as m:
        switch(m, isa=tier)
        switch(m, amx=False)
        m.setitem(crossovers.TABLE, tier, crossovers.TABLE[BEST])
        assert _native.tier() == tier and _native.available(), _native.why_unavailable()
        return fn()


def _same(monkeypatch, tier: str, fn) -> None:
    """fn() at `tier` equals fn() at the CPU's best tier, to the bit."""
    best, got = _at(monkeypatch, BEST, fn), _at(monkeypatch, tier, fn)
    for b, g in zip(best if isinstance(best, tuple) else (best,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(g, b), (f"{tier} differs from {BEST}: max |diff| "
                                   f"{(g.float() - b.float()).abs().max().item()}")


def _gaussian(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_tier_is_capped_and_named(monkeypatch):
    switch(monkeypatch, isa="generic")
    assert _native.tier() == "generic"
    assert "generic tier, capped by settings isa (HF_DSINFER_ISA" in _native.describe_tier()
    with pytest.raises(ValueError, match="'avx1024' is not an ISA tier: expected one of generic"):
        settings.Settings.from_env({_native.ISA_ENV_VAR: "avx1024"})
    switch(monkeypatch, isa=None)
    assert _native.tier() == BEST


@pytest.fixture
def pretend_cpu(monkeypatch):
    """pretend_cpu(flags, compiler_lacks=()): _native sees an x86-64 CPU with these cpuinfo
    flags and a compiler without these -m flags (the cached tiers recomputed, and again after)."""

    def pretend(flags, compiler_lacks=()):
        monkeypatch.setattr(_native, "_cpu_flags", lambda: set(flags))
        monkeypatch.setattr(_native.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(_native, "_compiler_takes",
                            lambda fl: not set(fl) & set(compiler_lacks))
        _native.runnable_tiers.cache_clear()
        _native.cpu_tier.cache_clear()

    yield pretend
    _native.runnable_tiers.cache_clear()
    _native.cpu_tier.cache_clear()


AVX2 = ("avx2", "fma", "f16c")
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def test_avx2_vnni_is_a_branch_off_avx2(monkeypatch, pretend_cpu):
    """AVX-VNNI (Intel's client CPUs from Alder Lake, Zen 5) is not in Skylake-SP to Ice Lake,
    so the avx512 tiers do not build with it or need it; a cap at avx2_vnni runs avx2 on a CPU
    without it; a compiler without -mavxvnni (gcc < 11) leaves the tier out."""
    assert "-mavxvnni" in _native.tier_flags("avx2_vnni")
    assert not any("-mavxvnni" in _native.tier_flags(t) for t in ("avx512", "avx512_bf16", "amx"))
    pretend_cpu((*AVX2, *AVX512))  # Ice Lake server
    assert _native.runnable_tiers() == ("generic", "avx2", "avx512")
    assert _native.cpu_tier() == "avx512"
    switch(monkeypatch, isa="avx2_vnni")
    assert _native.tier() == "avx2"
    switch(monkeypatch, isa="amx")
    assert _native.tier() == "avx512"
    pretend_cpu((*AVX2, "avx_vnni"))  # Alder Lake
    assert _native.runnable_tiers() == ("generic", "avx2", "avx2_vnni")
    assert _native.tier() == "avx2_vnni"
    switch(monkeypatch, isa="avx2")
    assert _native.tier() == "avx2"
    pretend_cpu((*AVX2, "avx_vnni", *AVX512, "avx512_bf16"), compiler_lacks=("-mavxvnni",))
    assert _native.runnable_tiers() == ("generic", "avx2", "avx512", "avx512_bf16")
    switch(monkeypatch, isa=None)
    assert _native.tier() == "avx512_bf16"


@pytest.mark.skipif(_native.compiler() is None, reason="no C compiler")
def test_a_tier_the_compiler_cannot_build_is_not_offered():
    """The real check behind runnable_tiers: the compiler is asked about the tier's flags."""
    assert _native._compiler_takes(("-mavx2", "-mfma")) == (_native.platform.machine().lower()
                                                            in ("x86_64", "amd64"))
    assert not _native._compiler_takes(("-mno-such-isa-flag",))
    assert _native._compiler_takes(())


def _spy_lib(monkeypatch) -> list:
    """Record what every _native.lib(use) call returns."""
    real, given = _native.lib, []

    def spy(use="kernels"):
        given.append((use, real(use)))
        return given[-1][1]

    monkeypatch.setattr(_native, "lib", spy)
    return given


HAS_AVX2 = _native.TIERS.index(BEST) >= _native.TIERS.index("avx2")


@pytest.mark.skipif(not HAS_AVX2, reason="pretends an AVX2 CPU: runs the avx2 library")
def test_an_avx2_cpu_leaves_only_the_row_wise_norm_and_rope_to_torch(monkeypatch):
    """On a CPU whose best tier is avx2 (pretended), the decode layer, the int8 GEMV, the int4
    products and prefill dequantization run natively (the tier's own loops, csrc/hfd_avx2.h),
    while the row-wise RMSNorm / RoPE keep torch's ops (MIN_TIER), and explain says so; a named
    tier runs them."""
    switch(monkeypatch, isa=None)
    monkeypatch.setattr(_native, "cpu_tier", lambda: "avx2")
    assert _native.lib() is _native._load("avx2")
    assert all(_native.lib(use) is _native._load("avx2")
               for use in ("int4", "gemv", "dequantize", "panel", "bf16_gemv"))
    assert _native.lib("rows") is None
    assert "rows (the avx2 tier, where 'rows' kernels" in _native.describe_tier()
    assert _decode_logits(None) is not None  # asserts the native layer ran
    assert _decode_logits({"bits": 4, "group_size": 32}) is not None
    q4 = Q.quantize_int4(_gaussian(64, 256, seed=12), 32)
    assert q4.tiled and q4.cpu_packed is None  # the native kernel reads the tiles
    q8 = Q.quantize_int8(_gaussian(64, 256, seed=9))
    assert q8.tiled
    gemv = []
    real = Q._native_int8
    monkeypatch.setattr(Q, "_native_int8", lambda *a: gemv.append(1) or real(*a))
    Q.linear_int8(_gaussian(1, 256, seed=10), q8, backend="cpu")
    assert gemv == [1]
    switch(monkeypatch, isa="avx2")
    assert _native.lib("rows") is _native._load("avx2")


@pytest.mark.skipif(not HAS_AVX2, reason="compares with the avx2 library")
def test_a_generic_cpu_runs_only_what_beats_torch_element_wise(monkeypatch):
    """Below MIN_TIER["kernels"] (a pretended generic CPU) the matrix kernels stay off, while
    the KV-code kernel still runs (counted: fails if the use were ignored)."""
    switch(monkeypatch, isa=None)
    monkeypatch.setattr(_native, "cpu_tier", lambda: "generic")
    assert _native.lib() is None and "the generic tier" in _native.why_unavailable()
    assert _native.lib("codes") is _native._load("generic")
    given = _spy_lib(monkeypatch)
    KV.quantize_kv_int4(_gaussian(2, 4, 64, seed=11), 32, backend="cpu")
    assert given and all(lib is not None for _, lib in given)  # the native KV kernel ran


ALL_TIERS = pytest.mark.parametrize("tier", LOWER)
NO_LOWER = pytest.mark.skipif(not LOWER, reason=f"no tier below {BEST} to compare with")


@NO_LOWER
@ALL_TIERS
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("rows,n,k", [(1, 256, 320), (3, 64, 300), (2, 128, 1024)])
def test_int8_linear(monkeypatch, tier, dtype, rows, n, k):
    qw = Q.quantize_int8(_gaussian(n, k, seed=1, dtype=dtype))
    x = _gaussian(rows, k, seed=2, dtype=dtype)
    _same(monkeypatch, tier, lambda: Q.linear_int8(x, qw, backend="cpu"))


@NO_LOWER
@ALL_TIERS
@pytest.mark.parametrize("rows,n,k,group", [(1, 64, 1024, 32), (4, 128, 640, 64),
                                            (2, 64, 160, 32)])
def test_int4_linear(monkeypatch, tier, rows, n, k, group):
    qw = Q.quantize_int4(_gaussian(n, k, seed=3), group)
    x = _gaussian(rows, k, seed=4)
    _same(monkeypatch, tier, lambda: Q.linear_int4(x, qw, backend="cpu"))


@NO_LOWER
@ALL_TIERS
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("portable", (False, True), ids=("tiles", "row_major"))
def test_int4_linear_inputs(monkeypatch, tier, dtype, portable):
    """x in fp32 and fp16 as well, and the codes row-major: the avx2 tier prepares x's planes
    in code of its own (cpu_decode.c: int4_input_avx2), and the planes' order differs between
    tiles and rows; 640 columns leave a 128-column rest past the tiles' whole runs."""
    qw = Q.quantize_int4(_gaussian(128, 640, seed=6), 64, portable=portable)
    x = _gaussian(3, 640, seed=7, dtype=dtype)
    _same(monkeypatch, tier, lambda: Q.linear_int4(x, qw, backend="cpu"))


def _exp_inputs() -> torch.Tensor:
    """Every fp32 in [-2, 2] step 2^-12, a dense sweep of [-120, 100], the ranges where
    e^x's exponent leaves the normal range (x < -87.3: subnormal results; x > 88.37:
    n = 128 in the exponent split) one ulp apart, and the special values."""
    edges = [torch.arange(-2, 2, 2.0 ** -12),
             torch.linspace(-120, 100, 200_001),
             torch.linspace(-104.5, -86.5, 100_001),
             torch.linspace(88.3, 88.73, 50_001),
             torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.7228,
                           88.72284, -103.9721, -103.97209, -87.33655, 1e-30, -1e-30])]
    x = torch.cat([t.float() for t in edges])
    return torch.cat([x, torch.nextafter(x, torch.full_like(x, float("inf")))])


def _exp(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    assert _native.lib().hfd_exp_f32(x.data_ptr(), x.numel(), y.data_ptr()) == 0
    return y


@NO_LOWER
@ALL_TIERS
def test_exp(monkeypatch, tier):
    """exp_ps, the exponential of the kernels' softmax, SiLU, GELU and tanh, bit for bit: the
    avx2 tier's own 256-bit code and SIMDe's emulation at the generic tier give the AVX-512
    instructions' results, subnormal and largest values included."""
    x = _exp_inputs()
    _same(monkeypatch, tier, lambda: _exp(x))


def test_exp_is_within_an_ulp_or_two_of_expf():
    x = _exp_inputs()
    x = x[torch.isfinite(x) & (x > -87.3) & (x < 88.7)]
    got, ref = _exp(x).double(), torch.exp(x.double())
    ulp = (torch.nextafter(ref.float(), torch.full_like(x, float("inf"))).double()
           - ref.float().double())
    assert float(((got - ref).abs() / ulp).max()) < 2.0
    y = _exp(torch.tensor([float("inf"), 89.0, -float("inf"), -110.0, float("nan")]))
    assert y[:2].isinf().all() and float(y[2]) == 0.0 and float(y[3]) == 0.0
    assert float(y[4]) == float(_exp(torch.tensor([88.7228]))[0])  # a NaN: the clamp's top


@ALL_TIERS
@pytest.mark.parametrize("a8", (False, True), ids=("w4a16", "w4a8"))
def test_int4_row_ignores_its_neighbours_values(monkeypatch, tier, a8):
    """K = 576 (18 groups of 32, row-major codes): a row's last scales and mins are loaded with
    the next row's and masked (csrc/hfd_avx2.h: hfd_load8_in), so non-finite values there
    (inf * 0 = NaN) must not reach the row's result."""
    w = _gaussian(16, 576, seed=9)
    x = _gaussian(1, 576, seed=10)
    bad = w.clone()
    bad[1:] = float("inf")
    run = Q.linear_int4_a8_cpu if a8 else (lambda x, q: Q.linear_int4(x, q, backend="cpu"))
    got = [_at(monkeypatch, tier, lambda q=Q.quantize_int4(v, 32): run(x, q)[0, 0])
           for v in (w, bad)]
    assert torch.isfinite(got[0]) and torch.equal(got[0], got[1])


@NO_LOWER
@ALL_TIERS
def test_dequantize_rows(monkeypatch, tier):
    q4 = Q.quantize_int4(_gaussian(128, 512, seed=5), 64)
    q8 = Q.quantize_int8(_gaussian(64, 256, seed=6))
    _same(monkeypatch, tier, lambda: (Q.dequantize_int4_rows(q4, torch.bfloat16, 0, 128),
                                      Q._int8_rows(q8, torch.bfloat16, 0, 64)))


@NO_LOWER
@ALL_TIERS
def test_kv_codes(monkeypatch, tier):
    x = _gaussian(3, 2, 40, 64, seed=7)
    _same(monkeypatch, tier, lambda: tuple(KV.quantize_kv_int4(x, 32, backend="cpu")[:3]))


@NO_LOWER
@ALL_TIERS
def test_moe_expert_rows(monkeypatch, tier):
    g = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(4, 2 * 96, 64, generator=g) * 0.1).bfloat16()
    down = (torch.randn(4, 64, 96, generator=g) * 0.1).bfloat16()
    xs = torch.randn(6, 64, generator=g).bfloat16()
    offsets = torch.tensor([0, 2, 3, 5, 6])
    _same(monkeypatch, tier,
          lambda: M._native_moe_rows(_native.lib(), xs, gate_up, down, offsets, 6))


@NO_LOWER
@ALL_TIERS
@pytest.mark.parametrize("rep", [1, 2, 3, 8, 12])
@pytest.mark.parametrize("d", [32, 96, 128])
@pytest.mark.parametrize("case", ["plain", "masked", "softcap", "slots"])
def test_attend_rows(monkeypatch, tier, rep, d, case):
    """The decode layers' attention (csrc/cpu_decode.c: attend_heads; the avx2 tier scores 8
    keys at a time and runs its own softmax and passes over v) gives the best tier's bits: one
    head and groups of 2, 3, 8 and 8 + 4 heads, dims in passes of 64 with a 32-dim rest (d =
    96), spans of 1 to 300 keys (the 8- and 16-key blocks' rests), keys masked inside the
    spans, a soft-cap, and keys read in place through a read index."""
    gen = torch.Generator().manual_seed(rep * d + len(case))
    lens = [1, 7, 8, 9, 16, 17, 40, 300]
    n, hkv, keys = len(lens), 2, sum(lens)
    ends = torch.tensor(lens).cumsum(0)
    spans = torch.stack([torch.arange(n), ends - torch.tensor(lens), ends], 1).contiguous()
    q = (3 * torch.randn(1, hkv * rep, n, d, generator=gen)).bfloat16()
    k, v = (torch.randn(1, hkv, keys, d, generator=gen).bfloat16() for _ in range(2))
    keep = None
    if case == "masked":  # a third of the keys, and all of the second row's
        keep = (torch.rand(n, keys, generator=gen) > 0.33).to(torch.uint8)
        keep[1] = 0
    if case == "slots":
        k, v = _in_slots(k, v)

    def attend():
        out = torch.zeros_like(q)
        A.attend_rows_native(q, k, v, spans, keep, d ** -0.5, 5.0 if case == "softcap" else None,
                             out)
        return out

    _same(monkeypatch, tier, attend)


def _in_slots(k: torch.Tensor, v: torch.Tensor):
    """k, v [1, Hkv, K, D] as rows of a larger cache [S, Hkv, D] read through a shuffled index."""
    gen = torch.Generator().manual_seed(1)
    index = torch.randperm(3 * k.shape[2], generator=gen)[:k.shape[2]]
    slots = []
    for x in (k, v):
        cache = torch.randn(3 * k.shape[2], x.shape[1], x.shape[3], generator=gen).to(x.dtype)
        cache[index] = x[0].transpose(0, 1)
        slots.append(A.SlotRows(cache, index))
    return slots


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _decode_logits(quant):
    model = hf_dsinfer.init_inference(_llama(), dtype=torch.bfloat16, quant=quant)
    cache, out = DynamicCache(config=model.config), []
    with torch.inference_mode():
        model(torch.tensor([[4, 9, 16, 25]]), past_key_values=cache, use_cache=True)
        for tok in (7, 11, 13):
            out.append(model(torch.tensor([[tok]]), past_key_values=cache,
                             use_cache=True).logits[0, -1])
    calls = sum(layer.forward._decode.calls for layer in model.model.layers)
    assert calls > 0, "the native decode layer did not run"
    return torch.stack(out)


@NO_LOWER
@ALL_TIERS
@pytest.mark.parametrize("quant", [None, {"bits": 8}, {"bits": 4, "group_size": 32}],
                         ids=("bf16", "int8", "int4"))
def test_native_decode_layer(monkeypatch, tier, quant):
    _same(monkeypatch, tier, lambda: _decode_logits(quant))
