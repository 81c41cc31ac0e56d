"""ZeRO-Inference's parallel fetch: offload with 2 processes, each reading half of every layer
file (counted bytes), tokens identical to HF eager and to one rank reading whole files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import torchrun
from tiny_models import make_model

import hf_dsinfer
from hf_dsinfer.errors import DSInferError

WORKER = Path(__file__).with_name("fetch_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fetch")
    proc = torchrun(2, str(WORKER), str(out / "result"), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"result.{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    return ranks


@pytest.mark.multiprocess
def test_tokens_identical_to_world_one_and_hf(run):
    for rank in run:
        hf, whole, fetched = rank["tokens"]
        assert fetched == whole == hf
        assert rank["fused_calls"] > 0  # the fused blocks ran on the fetched weights


@pytest.mark.multiprocess
def test_each_rank_reads_half_of_every_layer(run):
    loads = run[0]["loads"]
    assert loads >= 12 and all(rank["loads"] == loads for rank in run)
    layer = run[0]["file_bytes"][0]
    assert sum(rank["read"] for rank in run) == loads * layer  # every byte read once
    for rank in run:
        assert rank["read"] + rank["gathered"] == loads * layer
        assert abs(rank["read"] / (loads * layer) - 0.5) < 0.02, rank["read"]
        assert "parallel fetch: rank" in rank["explain"]


def test_parallel_fetch_needs_disk_weights():
    with pytest.raises(DSInferError, match="splits the reads of the disk tier"):
        hf_dsinfer.init_inference(make_model("llama"), offload={"parallel_fetch": True})


def test_parallel_fetch_needs_a_process_group(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DSInferError, match="needs a torch.distributed process group"):
        hf_dsinfer.init_inference(make_model("llama"), offload={
            "weights": (0, 0, 100), "offload_dir": str(tmp_path), "parallel_fetch": True})
