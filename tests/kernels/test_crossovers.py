"""The per-tier row crossovers (kernels/crossovers.py): one row per ISA tier, the running tier's
row is the one the CPU linears read, and their dispatch follows it (counted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native, crossovers
from hf_dsinfer.kernels import quant as Q
from tests.kernels.conftest import count_calls, pin_crossovers

BEST = _native.cpu_tier()
RUNNABLE = _native.runnable_tiers()
AMX_FIELDS = ("amx_bf16_max_rows", "amx_int8_min_rows", "amx_int8_max_rows",
              "amx_int4_max_rows")


def test_every_tier_has_a_row():
    assert set(crossovers.TABLE) == set(_native.TIERS)
    for tier, row in crossovers.TABLE.items():
        values = dataclasses.asdict(row)
        amx = [values.pop(name) for name in AMX_FIELDS]
        gemv = values.pop("bf16_gemv_max_rows")  # None where not measured: torch's path
        assert gemv is None if tier == "amx" else isinstance(gemv, int) and gemv >= 1, tier
        panel = values.pop("int4_gemm_max_rows")  # likewise: dequantize + GEMM there
        assert (panel is None if tier == "amx"
                else isinstance(panel, int) and panel > row.int4_native_max_rows), tier
        # likewise; equal to the GEMV's where the GEMV wins throughout (avx2_vnni)
        panel8 = values.pop("int8_gemm_max_rows")
        assert (panel8 is None if tier == "amx"
                else isinstance(panel8, int) and panel8 >= row.int8_gemv_max_rows), tier
        bf16 = values.pop("bf16_gemm_max_rows")  # likewise: F.linear there
        assert bf16 is None if tier == "amx" else isinstance(bf16, int) and bf16 > gemv, tier
        assert all(isinstance(v, int) and v >= 1 for v in values.values()), (tier, row)
        if tier == "amx":  # the only tier with AMX tiles
            assert all(isinstance(v, int) and v >= 1 for v in amx) and amx[1] <= amx[2]
            assert amx[3] > row.int4_native_max_rows  # the AMX int4 kernel follows it
        else:
            assert amx == [None] * len(AMX_FIELDS), f"{tier} has no AMX, but bounds: {amx}"


def test_below_its_min_tier_a_kernel_keeps_the_bound_of_the_tier_above():
    """A tier where the int8 GEMV does not run by default (MIN_TIER) has no measurement of its
    own: it keeps the bound of the lowest tier where it runs (used when HF_DSINFER_ISA names
    the tier)."""
    first = _native.MIN_TIER["gemv"]
    for tier in _native.TIERS[: _native.TIERS.index(first)]:
        assert (crossovers.TABLE[tier].int8_gemv_max_rows
                == crossovers.TABLE[first].int8_gemv_max_rows), tier


@pytest.mark.parametrize("tier", RUNNABLE)
def test_rows_are_the_running_tiers(monkeypatch, tier):
    switch(monkeypatch, isa=tier)
    assert crossovers.rows() is crossovers.TABLE[tier]
    assert crossovers.rows("amx") is crossovers.TABLE["amx"]


def test_rows_follow_the_cpu(monkeypatch):
    """Without a cap, the CPU's best tier decides (an AMX Xeon pretended here)."""
    switch(monkeypatch, isa=None)
    monkeypatch.setattr(_native, "cpu_tier", lambda: "amx")
    assert crossovers.rows() is crossovers.TABLE["amx"]
    monkeypatch.setattr(_native, "cpu_tier", lambda: "generic")
    assert crossovers.rows() is crossovers.TABLE["generic"]


@pytest.mark.skipif(not _native.builds(), reason=f"native kernels: {_native.why_unavailable()}")
def test_linears_dispatch_on_the_row(monkeypatch):
    """Pinned bounds of 2 rows (int8 GEMV), 1 row (int4) and 2 rows (the int4 panel kernel): the
    native kernels take exactly that many rows, the next row count goes to the next path (and gives the same numbers within
    the tolerance of the other path's roundings)."""
    switch(monkeypatch, isa=BEST)  # a named tier runs every kernel
    switch(monkeypatch, amx=False)
    pin_crossovers(monkeypatch, int8_gemv_max_rows=2, int4_native_max_rows=1,
                   int4_gemm_max_rows=2)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=gen) * 0.05).bfloat16()
    x = torch.randn(3, 256, generator=gen).bfloat16()
    q8, q4 = Q.quantize_int8(w), Q.quantize_int4(w, 32)
    gemv, int4 = count_calls(monkeypatch, Q, "_native_int8"), count_calls(monkeypatch, Q,
                                                                          "_native_int4")
    for rows, want in ((2, [1]), (3, [])):
        gemv.clear()
        out = Q.linear_int8(x[:rows], q8, backend="cpu")
        assert gemv == want, rows
        torch.testing.assert_close(out, Q.linear_int8_ref(x[:rows], q8), atol=2e-2, rtol=2e-2)
    panel = count_calls(monkeypatch, Q, "_native_int4_gemm")
    for rows, want, want_panel in ((1, [1], []), (2, [], [1]), (3, [], [])):
        int4.clear()
        panel.clear()
        out = Q.linear_int4(x[:rows], q4, backend="cpu")
        assert (int4, panel) == (want, want_panel), rows
        torch.testing.assert_close(out, Q.linear_int4_ref(x[:rows], q4), atol=2e-2, rtol=2e-2)
