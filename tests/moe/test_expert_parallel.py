"""Expert parallelism: ep=2 and ep=4 (gloo, CPU) against ep=1, and the placement arithmetic.

One torchrun launch per world size runs ep_worker.py, which checks several models and layouts
(flat and hierarchical all-to-all, top-1, shared expert, expert slicing, bf16) and writes one
JSON per rank; the tests below assert on it. Ranks feed different prompts and ask for different
numbers of new tokens, so the ranks that finish first must keep joining the all-to-alls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import torchrun
from tiny_models import make_model

import hf_dsinfer
from hf_dsinfer.parallel.expert import (
    ExpertParallelError,
    ExpertPlacement,
    a2a_bytes_per_token,
    plan_placement,
    route_pairs,
    unpack_entries,
)

WORKER = Path(__file__).with_name("ep_worker.py")
FP32_LOGIT_ATOL = 1e-4
BF16_LOGIT_RTOL = 3e-2
CASES = {2: ["flat", "hier", "top1", "shared", "slicing", "bf16", "gpt_oss", "deepseek_v3"],
         4: ["flat", "hier", "slicing"]}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"ep{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"ep{world}")
    proc = torchrun(world, str(WORKER), str(out), *CASES[world])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return world, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.multiprocess
def test_ep_matches_ep1(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        for case in CASES[world]:
            r = result[case]
            if r["dtype"] == "torch.float32":
                assert r["logit_max_abs"] <= FP32_LOGIT_ATOL, (world, rank, case, r)
                assert r["tokens_equal"], (world, rank, case)
            else:
                assert r["logit_max_abs"] <= BF16_LOGIT_RTOL * r["logit_scale"], (rank, case, r)
            assert r["explain_has_ep"]


@pytest.mark.multiprocess
def test_early_finishers_keep_joining_the_all_to_alls(ranks):
    """Rank r asks for 3 + 3r new tokens; every rank still ran every MoE call, all through EP."""
    world, results = ranks
    for case in CASES[world]:
        calls = {res[case]["moe_calls"] for res in results}
        assert len(calls) == 1, (case, calls)
        assert all(res[case]["a2a_calls"] == res[case]["moe_calls"] > 0 for res in results)


@pytest.mark.multiprocess
def test_experts_sharded_and_sliced(ranks):
    world, results = ranks
    for res in results:
        assert res["flat"]["local_experts"] == 8 // world
        assert res["slicing"]["local_experts"] == 1
        assert res["slicing"]["local_intermediate"] == 56 // world  # expert slicing
        assert res["flat"]["bytes_per_token"] > 0


def test_placement_whole_experts_and_slices():
    p = ExpertPlacement(num_experts=8, ep_size=4, rank=1)
    assert list(p.local_experts()) == [2, 3] and p.slices == 1
    slot, dest, local = p.route(torch.tensor([[0, 3], [7, 8]]))  # 8: a dropped slot
    assert slot.tolist() == [0, 1, 2] and dest.tolist() == [0, 1, 3]
    assert local.tolist() == [0, 1, 1]
    s = ExpertPlacement(num_experts=2, ep_size=4, rank=3)
    assert s.slices == 2 and list(s.local_experts()) == [1]
    assert s.intermediate_slice(10) == slice(5, 10)
    slot, dest, _ = s.route(torch.tensor([[1], [0]]))
    assert slot.tolist() == [0, 0, 1, 1] and dest.tolist() == [2, 3, 0, 1]


@pytest.mark.parametrize("ep_size", (3, 5, 6))
def test_ep_size_that_does_not_fit_is_refused(ep_size):
    with pytest.raises(ExpertParallelError, match=r"Fix: use ep_size in \[1, 2, 4, 8"):
        plan_placement(8, 56, ep_size, 0)
    model = make_model("mixtral_8x2")
    with pytest.raises(ExpertParallelError, match="does not fit 8 experts"):
        hf_dsinfer.init_inference(model, ep_size=ep_size)
    assert "forward" not in model.model.layers[0].__dict__  # untouched


def test_ep_on_dense_model_is_refused():
    with pytest.raises(ExpertParallelError, match="no mixture-of-experts"):
        hf_dsinfer.init_inference(make_model("llama"), ep_size=2)


def test_a2a_bytes_against_minimum():
    ids = torch.tensor([[0, 1], [4, 5], [0, 4], [6, 7]])  # 8 experts, rank 0 of 2 holds 0-3
    ours, minimum = a2a_bytes_per_token(ExpertPlacement(8, 2, 0), ids, hidden=4, elem_bytes=2)
    # tokens 1, 2, 3 go to rank 1 once each (token 1 and 3 for two of its experts): 3 rows out
    # and 3 pre-summed rows back (8 B each), 2 fp32 (id, weight) entries each, two 8-byte
    # counts; the minimum is the rows alone
    assert ours == (3 * (2 * 8 + 2 * 2 * 4) + 16) / 4 and minimum == 3 * 2 * 8 / 4


def test_route_pairs_send_a_token_once_per_rank():
    ids = torch.tensor([[0, 1], [4, 5], [0, 4], [7, 8]])  # 8: a dropped slot
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.0]])
    pairs = route_pairs(ExpertPlacement(8, 2, 0), ids, weights)
    assert pairs.token.tolist() == [0, 1, 2, 2, 3] and pairs.dest.tolist() == [0, 1, 0, 1, 1]
    assert pairs.local.tolist() == [[0, 1], [0, 1], [0, 4], [4, 0], [3, 4]]  # 4: unused entry
    want = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0], [0, 0.5], [0.9, 0]])
    assert torch.equal(pairs.weight, want)
    local, w = unpack_entries(pairs.entries(), weights.dtype)
    assert torch.equal(local, pairs.local) and torch.equal(w, pairs.weight)
    sliced = route_pairs(ExpertPlacement(1, 2, 0), torch.tensor([[0]]), torch.tensor([[1.0]]))
    assert sliced.dest.tolist() == [0, 1] and sliced.local.tolist() == [[0], [0]]
