"""benchmarks/moe.py: its FusedMoE row runs FusedMoE, not HF's experts (tiny shapes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe.py"


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fused_row_times_fusedmoe_after_the_hf_rows_switch_implementations(bench, monkeypatch):
    """The HF providers set the block's experts implementation; FusedMoE hands a block whose
    implementation changed after injection back to HF, so without the provider restoring it
    the "hf_dsinfer FusedMoE" row timed HF's last implementation. Every call of that row must
    be a FusedMoE call (counted): the check against HF eager, the warm-up and each repeat."""
    made = []
    real = bench.fused_moe
    monkeypatch.setattr(bench, "fused_moe", lambda block: made.append(real(block)) or made[-1])
    block = bench.build_block(64, 96, 4, 2)
    rows = bench.layer_table(block, [3, 40], reps=2, bandwidth=1.0)
    assert len(made) == 1 and made[0].fused.calls == 2 * (1 + 1 + 2)
    assert sum("hf_dsinfer FusedMoE" in r for r in rows) == 2
