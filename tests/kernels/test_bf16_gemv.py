"""The bf16 products of a few rows (csrc/cpu_experts.c): hfd_gemv_bf16 under kernels.linear
(nn.Linear's [out, in] weight) and hfd_matmul_kn_bf16 under kernels.matmul_kn (a weight stored
[in, out], gpt-oss's experts), against torch on odd shapes; the same bits at every ISA tier; the
dispatch (which calls take them, counted); a bf16 gpt-oss decode running them. And the panel
kernel that takes over after the GEMV's rows (csrc/cpu_qgemm.c: hfd_gemm_bf16)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from switches import switch
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels import linear as lin
from hf_dsinfer.kernels import matmul_kn as kn
from tests.kernels.test_native_tiers import LOWER, _same

pytestmark = pytest.mark.skipif(not _native.builds(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")

# rows, out, in: K past a multiple of 32 (masked tail), out not a multiple of the 4-row blocks
LINEAR_SHAPES = [(1, 48, 80), (3, 37, 300), (4, 130, 33), (2, 16, 1000)]
# rows, in, out (out a multiple of 16); K not a multiple of the 4-row unroll
KN_SHAPES = [(1, 80, 48), (3, 37, 64), (4, 1030, 32), (2, 5, 2880)]
ULP_FRACTION = 0.01  # outputs allowed one bf16 ulp from torch's (the fp32 sums' order)


def _gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _close_to(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to torch's bf16 result but for a few outputs one unit in the last place apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    ulp = (want.float().abs() * 2.0**-7).clamp_min(2.0**-126)
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp).all(), diff.max()
    assert (got != want).float().mean() <= ULP_FRACTION


def _counting(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def _gemv_runs() -> bool:
    return (crossovers.rows().bf16_gemv_max_rows is not None
            and _native.lib("bf16_gemv") is not None)


def _gemm_runs() -> bool:
    return (crossovers.rows().bf16_gemm_max_rows is not None
            and _native.lib("bf16_gemv") is not None)


# rows (past the GEMV's 4), out (a multiple of 4, not of the 16-row panels), in (of 32)
GEMM_SHAPES = [(5, 48, 64), (13, 36, 320), (16, 132, 1024), (7, 4, 32)]


@pytest.mark.skipif(not _gemm_runs(), reason="the bf16 panel kernel does not run at this tier")
def test_gemm_rows_do_not_depend_on_their_batch_or_the_threads():
    lib = _native.lib("bf16_gemv")
    x, w, b = _gaussian(13, 320, seed=24), _gaussian(36, 320, seed=25), _gaussian(36, seed=26)
    many = lin._native_gemm(lib, x, w, b)
    assert torch.equal(many, torch.cat([lin._native_gemm(lib, x[i:i + 1], w, b)
                                        for i in range(13)]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(many, lin._native_gemm(lib, x, w, b))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("kernel", "rows", "n", "k"),
                         [("_native_gemv", *shape) for shape in LINEAR_SHAPES]
                         + [("_native_gemm", *shape) for shape in GEMM_SHAPES])
def test_linear_kernels_match_f_linear(monkeypatch, kernel, rows, n, k, bias):
    """The GEMV for 1-4 rows, the panel kernel past them: F.linear's bf16 but for the last
    bit here and there, the kernel counted where the tier runs it."""
    x, w = _gaussian(rows, k, seed=1), _gaussian(n, k, seed=2)
    b = _gaussian(n, seed=3) if bias else None
    calls = _counting(monkeypatch, lin, kernel)
    _close_to(lin.linear(x, w, b, backend="cpu"), F.linear(x, w, b))
    runs = _gemv_runs() if kernel == "_native_gemv" else _gemm_runs()
    assert calls == ([1] if runs else [])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "k", "n"), KN_SHAPES)
def test_matmul_kn_matches_torch(monkeypatch, rows, k, n, bias):
    x, w = _gaussian(rows, k, seed=4), _gaussian(k, n, seed=5)
    b = _gaussian(n, seed=6) if bias else None
    calls = _counting(monkeypatch, kn, "_native_matmul_kn")
    _close_to(kn.matmul_kn(x, w, b, backend="cpu"), x @ w + (0 if b is None else b))
    assert calls == ([1] if _native.lib("bf16_gemv") is not None else [])


def test_what_stays_on_torch(monkeypatch):
    """fp32, too many rows, a strided weight, out % 16 != 0, grad: torch's ops, exactly."""
    calls = _counting(monkeypatch, lin, "_native_gemv")
    gemm_calls = _counting(monkeypatch, lin, "_native_gemm")
    x, w = _gaussian(2, 64, seed=7), _gaussian(48, 64, seed=8)
    assert torch.equal(lin.linear(x.float(), w.float(), backend="cpu"), F.linear(x.float(),
                                                                                  w.float()))
    bounds = crossovers.rows()
    many = torch.cat([x] * ((bounds.bf16_gemm_max_rows or bounds.bf16_gemv_max_rows or 4) // 2
                            + 1))  # more rows than the native kernels take
    assert torch.equal(lin.linear(many, w, backend="cpu"), F.linear(many, w))
    odd = _gaussian(8, 300, seed=27)  # in features not a multiple of 32: not the panel kernel
    assert torch.equal(lin.linear(odd, _gaussian(48, 300), backend="cpu"),
                       F.linear(odd, _gaussian(48, 300)))
    assert calls == [] and gemm_calls == []
    kn_calls = _counting(monkeypatch, kn, "_native_matmul_kn")
    wk = _gaussian(64, 40, seed=9)
    for args in ((x, wk), (torch.cat([x] * 4), _gaussian(64, 48)), (x, _gaussian(48, 64).t())):
        assert torch.equal(kn.matmul_kn(*args, backend="cpu"), args[0] @ args[1])
    assert kn_calls == []
    with torch.enable_grad():
        w.requires_grad_(True)
        assert lin.linear(x, w, backend="cpu").requires_grad


def test_below_its_tier_torch_computes(monkeypatch):
    """A CPU without AVX2 (pretended): no native bf16 products (MIN_TIER); torch.mv for one
    row. An AVX2 CPU (pretended) runs them: its own loops beat oneDNN's AVX2 GEMMs
    (kernels/crossovers.py)."""
    switch(monkeypatch, isa=None)
    monkeypatch.setattr(_native, "cpu_tier", lambda: "generic")
    assert _native.lib("bf16_gemv") is None and _native.lib("panel") is None
    calls = _counting(monkeypatch, lin, "_native_gemv")
    x, w = _gaussian(1, 64, seed=10), _gaussian(48, 64, seed=11)
    assert torch.equal(lin.linear(x, w, backend="cpu"), torch.mv(w, x[0])[None])
    assert calls == []
    assert "bf16_gemv (the generic tier" in _native.describe_tier()
    monkeypatch.setattr(_native, "cpu_tier", lambda: "avx2")
    assert _native.lib("bf16_gemv") is not None and _native.lib("panel") is not None
    _close_to(lin.linear(torch.cat([x] * 3), w, backend="cpu"), F.linear(torch.cat([x] * 3), w))
    assert calls == [1]


@pytest.mark.skipif(not LOWER, reason="no tier below this CPU's best to compare with")
@pytest.mark.parametrize("tier", LOWER)
def test_every_tier_gives_the_same_bits(monkeypatch, tier):
    x, w, b = _gaussian(3, 300, seed=12), _gaussian(37, 300, seed=13), _gaussian(37, seed=14)
    xk, wk, bk = _gaussian(2, 37, seed=15), _gaussian(37, 64, seed=16), _gaussian(64, seed=17)
    xg, wg, bg = _gaussian(13, 320, seed=18), _gaussian(36, 320, seed=19), _gaussian(36, seed=20)
    _same(monkeypatch, tier, lambda: (
        lin._native_gemv(_native.lib("bf16_gemv"), x, w, b),
        kn._native_matmul_kn(_native.lib("bf16_gemv"), xk, wk, bk),
        lin._native_gemm(_native.lib("bf16_gemv"), xg, wg, bg)))


def test_gpt_oss_bf16_decode_runs_them(monkeypatch):
    """A bf16 gpt-oss decode: the experts' transposed products run hfd_matmul_kn_bf16, the
    attention's projections hfd_gemv_bf16; logits close to HF's (the bf16 tolerance)."""
    if not _gemv_runs():
        pytest.skip("the native bf16 products do not run at this tier")
    ref = make_model("gpt_oss", dtype=torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    ids, mask = prompts(batch=1)
    kn_calls = _counting(monkeypatch, kn, "_native_matmul_kn")
    gemv_calls = _counting(monkeypatch, lin, "_native_gemv")
    with torch.inference_mode():
        out = fused.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert kn_calls and gemv_calls
    first = (out.logits[0].float() - want.logits[0].float()).abs().max().item()
    assert first <= 0.05 * want.logits[0].float().abs().max().item()
