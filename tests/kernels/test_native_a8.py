"""4-bit weights times 8-bit activations (W4A8: quant={"bits": 4, "act_bits": 8}).

The batch-1 kernel (csrc/cpu_decode.c: hfd_int4_a8_rows, which the native decode layer's a8_dots
also runs) must give the panel kernel's bits for every row, shape, layout, x dtype and tier, so
that linear_int4_a8_cpu may pick either by row count.

The torch reference (quant.linear_int4_a8_ref) defines the numbers: x quantized per row and
weight group to round-half-even(x * 127 / absmax), exact integer sums against the centred codes,
fp32 scaling. The native kernel (csrc/cpu_qgemm.c: hfd_int4_gemm_a8) must give them up to the
order of the fp32 sums over groups, at every ISA tier (bit for bit across tiers), for every row
count, and a row's result must not depend on the rows beside it. linear_int4 must call it for a
weight marked act_bits=8 (counted), at every row count.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import count_calls
from tests.kernels.test_native_panel import _gaussian
from tests.kernels.test_native_panel import _weight as panel_weight

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]


def _weight(n, k, group, s_dt=torch.bfloat16, portable=False, seed=0):
    """The panel tests' 4-bit weight, marked for 8-bit activations."""
    return panel_weight(n, k, group, s_dt, portable, seed)._replace(act_bits=8)


def _native_a8(x2, qw):
    dt = _native.DTYPE_CODES
    m, k = x2.shape
    n = qw.scales.shape[0]
    return Q._fp32_product(_native.lib("a8"), "hfd_int4_gemm_a8", m, n, x2.data_ptr(),
                           dt[x2.dtype], m, qw.packed.data_ptr(), qw.scales.data_ptr(),
                           qw.mins.data_ptr(), dt[qw.scales.dtype], qw.group_size, n, k,
                           int(qw.tiled))


def _native_rows(x2, qw, lib=None):
    dt = _native.DTYPE_CODES
    m, k = x2.shape
    n = qw.scales.shape[0]
    return Q._fp32_product(lib or _native.lib("a8"), "hfd_int4_a8_rows", m, n, x2.data_ptr(),
                           dt[x2.dtype], m, qw.packed.data_ptr(), qw.scales.data_ptr(),
                           qw.mins.data_ptr(), dt[qw.scales.dtype], qw.group_size, n, k,
                           int(qw.tiled))


def _ref_fp32(x2, qw):
    return Q.linear_int4_a8_ref(x2.float(), qw)


# (n, k, group, portable): tiles with whole 512-column runs and a rest (1152), row-major codes
# (the offload engine's), 16 / 48 / 80 rows (register blocks of 2 x 16 rows and their tails), a
# row of 96 columns (no whole 64-byte run), and a panel boundary (112 rows at 2 threads)
SHAPES = [(48, 1152, 32, False), (32, 384, 128, False), (16, 1024, 256, True),
          (80, 512, 64, True), (16, 96, 32, False), (112, 2048, 128, False)]


@pytest.mark.parametrize("x_dt", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("n,k,group,portable", SHAPES)
def test_native_matches_the_reference(n, k, group, portable, x_dt):
    qw = _weight(n, k, group, portable=portable)
    for m in (1, 5, 6, 7, 13):
        x = _gaussian(m, k, seed=m).to(x_dt)
        y = _native_a8(x, qw)
        ref = _ref_fp32(x, qw)
        assert y is not None and y.dtype == torch.float32
        # the same integer sums; only the order of the fp32 sums over groups differs
        torch.testing.assert_close(y, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)


# the batch-1 kernel's shapes: SHAPES and odd row counts (blocks of 16 / 8 rows and their
# tails), a 576-column row (SmolLM2: one 512-column run and half a chunk), groups 32-256 over
# whole runs and rests, row-major and tiled codes
ROW_SHAPES = SHAPES + [(20, 576, 64, True), (36, 576, 32, False), (48, 2560, 256, False),
                       (64, 640, 128, True), (8, 1536, 64, False)]


@pytest.mark.parametrize("x_dt", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("n,k,group,portable", ROW_SHAPES)
def test_batch_one_kernel_gives_the_panel_kernels_bits(n, k, group, portable, x_dt):
    qw = _weight(n, k, group, portable=portable, seed=n + k)
    x = _gaussian(5, k, seed=k).to(x_dt)
    x[1, :group] = 0  # an all-zero group: unit 0
    x[2] *= torch.logspace(-4, 2, k)  # groups of very different scales
    rows = _native_rows(x, qw)
    assert rows is not None
    if n % 16 == 0:  # where the panel kernel runs
        assert torch.equal(rows, _native_a8(x, qw))
    ref = _ref_fp32(x, qw)
    torch.testing.assert_close(rows, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    for i in (0, 4):  # one row alone: the same bits
        assert torch.equal(_native_rows(x[i:i + 1].contiguous(), qw)[0], rows[i])


@pytest.mark.parametrize("s_dt", (torch.float32, torch.float16))
def test_batch_one_kernel_scale_dtypes(s_dt):
    qw = _weight(48, 1152, 64, s_dt=s_dt)
    x = _gaussian(3, 1152).bfloat16()
    assert torch.equal(_native_rows(x, qw), _native_a8(x, qw))


def test_out_features_the_panel_kernel_refuses_take_the_reference_at_every_row_count():
    """The batch-1 kernel would take 40 rows, but the panel kernel does not: one row takes the
    reference too, so that a row's numbers do not depend on the row count."""
    qw = _weight(40, 256, 32)
    x = _gaussian(1, 256).bfloat16()
    assert _native_rows(x, qw) is not None and _native_a8(x, qw) is None
    assert torch.equal(Q.linear_int4_a8_cpu(x, qw), Q.linear_int4_a8_ref(x, qw))


@pytest.mark.parametrize("s_dt", (torch.float32, torch.float16))
def test_scale_dtypes(s_dt):
    qw = _weight(48, 512, 64, s_dt=s_dt)
    x = _gaussian(9, 512).bfloat16()
    ref = _ref_fp32(x, qw)
    torch.testing.assert_close(_native_a8(x, qw), ref, atol=2e-5 * ref.abs().max().item(),
                               rtol=1e-5)


def test_a_row_does_not_depend_on_its_neighbours_or_threads():
    """Each output is the same sequence of operations wherever its row sits in a register block
    and whichever thread's panel holds it: bit for bit."""
    qw = _weight(112, 1024, 128)
    x = _gaussian(23, 1024).bfloat16()
    whole = _native_a8(x, qw)
    for i in (0, 5, 6, 22):
        assert torch.equal(_native_a8(x[i:i + 1].contiguous(), qw)[0], whole[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native_a8(x, qw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)


def test_every_tier_gives_the_same_bits():
    qw = _weight(48, 1152, 32)
    x = _gaussian(7, 1152).bfloat16()
    outs = {}
    for tier in _native.runnable_tiers():
        lib = _native._load(tier)
        if lib is None:
            continue
        dt = _native.DTYPE_CODES
        y = torch.empty(7, 48)
        code = lib.hfd_int4_gemm_a8(x.data_ptr(), dt[x.dtype], 7, qw.packed.data_ptr(),
                                    qw.scales.data_ptr(), qw.mins.data_ptr(),
                                    dt[qw.scales.dtype], 32, 48, 1152, int(qw.tiled),
                                    y.data_ptr(), 2)
        assert code == 0
        outs[tier] = y
    first = next(iter(outs.values()))
    for tier, y in outs.items():
        assert torch.equal(y, first), tier
    for tier in outs:  # the batch-1 kernel too, at every tier (the avx2 loops are its own)
        assert torch.equal(_native_rows(x, qw, _native._load(tier)), first), tier


def test_quantized_activations():
    """The reference's 8-bit x: round half to even of x * (127 / absmax), clamped; an all-zero
    group gives codes 0 and unit 0; gsum is the group's sum of x itself."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 5] = 0.5 / 127  # exactly half a unit (absmax 1): rounds to even, 0
    x[0, 6] = 1.5 / 127  # rounds to 2
    codes, unit, gsum = Q.quantize_activations_int8(x, 32)
    assert codes.shape == (2, 2, 32)
    assert codes[0, 0, 5] == 0 and codes[0, 0, 6] == 2
    assert codes[0, 0].abs().max() == 127
    assert torch.equal(codes[0, 1], torch.zeros(32)) and unit[0, 1] == 0 and unit[1, 0] == 0
    assert unit[0, 0] == torch.tensor(1.0) / 127
    assert gsum[0, 0] == x[0, :32].sum()


def test_error_against_bf16_activations_is_bounded():
    """Other numbers than the exact product, by design: on Gaussian inputs and weights the
    relative error of W4A8 against x @ dequantize(W).T stays under 1% (groups of 128; centring
    the codes halves it, docs/performance.md)."""
    qw = _weight(256, 2048, 128)
    x = _gaussian(16, 2048).bfloat16()
    exact = x.float() @ Q.dequantize_int4(qw, torch.float32).T
    err = (_ref_fp32(x, qw) - exact).norm() / exact.norm()
    assert 1e-4 < err < 1e-2


@pytest.mark.parametrize("rows", (1, 4, 64))
def test_linear_int4_runs_the_kernel_for_a8_weights(monkeypatch, rows):
    from hf_dsinfer.kernels import crossovers

    calls = count_calls(monkeypatch, Q, "linear_int4_a8_cpu")
    fallbacks = count_calls(monkeypatch, Q, "linear_int4_a8_ref")
    kernels = []
    original = Q._fp32_product

    def counted(lib, name, *args):
        kernels.append(name)
        return original(lib, name, *args)

    monkeypatch.setattr(Q, "_fp32_product", counted)
    qw = _weight(48, 512, 64)
    bias = _gaussian(48).bfloat16()
    x = _gaussian(rows, 512).bfloat16()
    y = Q.linear_int4(x, qw, bias)
    assert calls and not fallbacks and y.dtype == torch.bfloat16  # the native kernel ran
    few = rows <= crossovers.rows().a8_rows_max_rows  # the tier's bound picks the kernel
    assert kernels == ["hfd_int4_a8_rows" if few else "hfd_int4_gemm_a8"]
    ref = Q.linear_int4_a8_ref(x, qw, bias)
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-2, rtol=1e-2)
    # unmarked weights keep bf16 activations
    plain = qw._replace(act_bits=16)
    calls.clear()
    Q.linear_int4(x, plain, bias)
    assert not calls


def test_shapes_the_kernel_does_not_take_fall_back_to_the_reference():
    qw = _weight(40, 256, 32)  # 40 out features: not a multiple of 16
    x = _gaussian(3, 256).bfloat16()
    assert _native_a8(x, qw) is None
    torch.testing.assert_close(Q.linear_int4(x, qw).float(),
                               Q.linear_int4_a8_ref(x, qw).float(), atol=0, rtol=0)
