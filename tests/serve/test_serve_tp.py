"""`hf-dsinfer serve` over a tensor-parallel model under torchrun: rank 0 answers, rank 1 follows
its schedule (tests/serve/tp_serve_worker.py, 2 processes, gloo)."""

from __future__ import annotations

import json

import pytest

from tests.launch import torchrun

pytestmark = pytest.mark.multiprocess


def test_tensor_parallel_server_answers_on_rank_0(tmp_path):
    out = tmp_path / "result.json"
    run = torchrun(2, "tests/serve/tp_serve_worker.py", str(out), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["drives"] is True  # rank 0 drove; rank 1 followed until rank 0 stopped
    tokens = [a["choices"][0]["token_ids"] for a in result["answers"]]
    assert tokens == result["expected"]  # greedy fp32: the single process's tokens
    assert all(a["choices"][0]["finish_reason"] == "length" for a in result["answers"])
    assert result["metrics"]["kv_blocks_in_use"] == 0
    assert sum(result["fused_calls"].values()) > 0
    assert result["batch"] == result["batch_expected"] and result["batch_same_on_every_rank"]
    assert result["restored"]  # the device mesh was set for the manager's construction only
