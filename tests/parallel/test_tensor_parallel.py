"""Tensor parallelism: every dense family (the 2026 ones included), gpt-oss and DeepSeek-V3 at
tp=2 and tp=3 (gloo, CPU), against HF eager.

One torchrun launch per world size runs tp_worker.py, which checks all families and writes JSON;
the tests below assert on it. tp=2 splits the 5-head models 3/2 (uneven), Llama's 6 heads / 3 KV
heads into 3/3 with KV heads kept per query head, Mistral's single KV head replicated; tp=3 gives
2/2/1 splits and splits Qwen2's GQA groups across ranks; gpt-oss's 4 heads (2 KV) and
DeepSeek-V3's 4 latent-attention heads go 2/2 and 2/1/1. The in-process tests cover the slicing
arithmetic and the errors that need no second process.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from launch import torchrun
from safetensors.torch import save_file
from tiny_models import CONFIGS, FAMILIES, MOE_2026, MOE_CONFIGS, make_model

import hf_dsinfer
from hf_dsinfer.errors import TensorParallelError
from hf_dsinfer.injection import policy as P
from hf_dsinfer.injection.policies import gpt2
from hf_dsinfer.parallel.loading import CheckpointReader
from hf_dsinfer.parallel.plan import linear_styles
from hf_dsinfer.parallel.slicing import ShardSpec, head_shard, qkv_ranges, split_sizes

WORKER = Path(__file__).with_name("tp_worker.py")
FP32_LOGIT_ATOL = 1e-4
WORLDS = [2, 3]


def _split_unevenly_by_3(name: str) -> bool:
    """Its query or KV heads do not divide by 3 (the tiny Llama-shaped models have 6 / 3)."""
    config = {**CONFIGS, **MOE_CONFIGS}[name]()
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
    return bool(heads % 3 or (kv or heads) % 3)  # Falcon names its KV heads num_kv_heads


# tp=3 is here for uneven splits (heads, KV heads, replicated KV), and three processes on CI's
# two cores make it the suite's slowest launch (189 s of a 1197 s suite, 2026-11-28). It runs
# Llama and the families whose heads 3 ranks split unevenly; the others split evenly at 3
# ranks as at 2 and run at tp=2 only.
FAMILIES_AT = {2: FAMILIES + MOE_2026,
               3: [f for f in FAMILIES + MOE_2026 if f == "llama" or _split_unevenly_by_3(f)]}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"tp{w}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tp{request.param}")
    proc = torchrun(request.param, str(WORKER), str(out / "result.json"), str(out),
                    *FAMILIES_AT[request.param])
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads((out / "result.json").read_text())["ranks"]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    return ranks


def _skip_unless_launched(run, name: str) -> None:
    if name not in run[0]["families"]:
        assert len(run) == 3 and name not in FAMILIES_AT[3], (len(run), name)
        pytest.skip(f"3 ranks split {name}'s heads evenly, as 2 do: tested at tp=2")


def test_tp3_runs_uneven_splits():
    """tp=3 keeps what it is for: 5-head, GQA-2, MQA and 4-head MoE / MLA models."""
    assert {"gpt2", "mistral", "qwen3", "phi3", "gpt_oss", "deepseek_v3"} <= set(FAMILIES_AT[3])
    assert "gemma2" not in FAMILIES_AT[3] and len(FAMILIES_AT[3]) < len(FAMILIES_AT[2])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FAMILIES + MOE_2026)
def test_logits_match_single_process(run, name):
    _skip_unless_launched(run, name)
    for rank in run:
        fam = rank["families"][name]
        assert fam["fused_ran"]
        assert fam["logits_max_diff"] <= FP32_LOGIT_ATOL        # sharded loading
        assert fam["in_place_logits_max_diff"] <= FP32_LOGIT_ATOL  # sliced after loading whole
        assert all(passed for _, passed in fam["parity"].values()), fam["parity"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FAMILIES + MOE_2026)
def test_tokens_identical_on_every_rank(run, name):
    _skip_unless_launched(run, name)
    first = run[0]["families"][name]
    for rank in run:
        fam = rank["families"][name]
        assert fam["greedy_tp"] == fam["greedy_hf"]
        # left-padded batch (the in-place split's weights: its logits above, as generate's
        # loop is the loaded model's)
        assert fam["batch_tp"] == fam["batch_hf"]
        assert fam["static_tp"] == fam["batch_hf"]  # static cache of local heads
        assert fam["sample_tp"] == fam["sample_hf"] == first["sample_tp"]


@pytest.mark.multiprocess
def test_uneven_and_replicated_heads(run):
    """Which heads each rank holds (first block): contiguous query runs covering every head."""
    for name in ("gpt2", "llama", "mistral", "qwen2"):
        q_runs = [tuple(rank["families"][name]["heads"][0][:2]) for rank in run]
        assert q_runs[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(q_runs))
    mistral_kv = [rank["families"]["mistral"]["heads"][0][2] for rank in run]
    assert mistral_kv == [[0]] * len(run)  # one KV head, replicated on every rank


@pytest.mark.multiprocess
def test_sinks_and_latent_attention_are_sliced_by_heads(run):
    """gpt-oss (4 query heads) and DeepSeek-V3 (4 MLA heads) compute on their local heads only:
    the ranks' heads add up to the model's, gpt-oss's sink logits follow them, and DeepSeek-V3's
    decode steps ran the absorbed attention over the (replicated) latent cache."""
    world = len(run)
    for name in run[0]["families"].keys() & set(MOE_2026):  # 4 query heads each, every layer
        local = [rank["families"][name]["local"] for rank in run]
        assert sum(part["num_heads"][0] for part in local) == 4
        assert all(part["num_heads"] == [split_sizes(4, world)[r]] * len(part["num_heads"])
                   for r, part in enumerate(local))
    for r, rank in enumerate(run):
        oss, mla = rank["families"]["gpt_oss"]["local"], rank["families"]["deepseek_v3"]["local"]
        assert oss["sinks"] == oss["num_heads"]
        assert mla["mla_heads"] == mla["num_heads"] and mla["absorbed_calls"] >= 15 * 2
        assert rank["families"]["gpt_oss"]["loaded_sharded"]  # read as this rank's slices


@pytest.mark.multiprocess
def test_parity_gate_catches_wrong_weights(run):
    for rank in run:
        (err, passed), = rank["gate_with_wrong_reference"].values()
        assert not passed and err > 0.1


@pytest.mark.multiprocess
def test_bad_input_raises_at_init(run):
    world = run[0]["world"]
    for rank in run:
        errors = rank["errors"]
        assert "larger than the world size" in errors["tp_larger_than_world"]
        assert "use tp_size in" in errors["heads_unsplittable"]
        assert "holds only its slices" in errors["save_pretrained_of_a_shard"]
        if world % 2:
            assert "must tile the world" in errors["tp_not_dividing_world"]


# -- in-process: no second process needed -------------------------------------------------------
def test_no_process_group_raises(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = make_model("gpt2")
    with pytest.raises(TensorParallelError, match="needs a torch.distributed process group"):
        hf_dsinfer.init_inference(model, tp_size=2)
    assert hf_dsinfer.fused_call_counts(model) == {}  # untouched


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_tp_size_validated(bad):
    with pytest.raises(ValueError, match="tp_size"):
        hf_dsinfer.DSInferConfig(tp_size=bad)


def test_tp_with_compile_rejected():
    with pytest.raises(ValueError,
                       match=r"compile=True cannot be combined with tp_size > 1 \(tp_size=2"):
        hf_dsinfer.DSInferConfig(tp_size=2, compile=True)


@pytest.mark.parametrize(("heads", "kv", "tp", "expected"), [
    (5, 5, 2, [((0, 3), (0, 1, 2)), ((3, 5), (3, 4))]),          # uneven MHA
    (6, 2, 3, [((0, 2), (0,)), ((2, 4), (0, 1)), ((4, 6), (1,))]),  # GQA groups split
    (5, 1, 3, [((0, 2), (0,)), ((2, 4), (0,)), ((4, 5), (0,))]),    # one KV head replicated
    (8, 2, 3, [((0, 3), (0,)), ((3, 6), (0, 1, 1)), ((6, 8), (1,))]),  # unequal: per-query KV
])
def test_head_shard(heads, kv, tp, expected):
    got = [dataclasses.astuple(head_shard(heads, kv, tp, r)) for r in range(tp)]
    assert got == expected


@pytest.mark.parametrize(("heads", "kv", "tp"), [(6, 2, 2), (6, 2, 3), (5, 1, 3), (8, 2, 3),
                                                (5, 5, 2), (6, 3, 4)])
def test_grouped_qkv_ranges_give_the_local_grouped_layout(heads, kv, tp):
    """Falcon's per-KV-head [q x group, k, v] rows: each rank's rows, read as the same layout
    with its local head counts, hold exactly its query heads and the KV heads HeadShard gives it
    (replicated and per-query KV heads included)."""
    d, group = 2, heads // kv
    rows = torch.arange(kv * (group + 2) * d).view(kv, group + 2, d)  # row ids, HF's view
    q_rows, k_rows, v_rows = rows[:, :group].reshape(heads, d), rows[:, group], rows[:, group + 1]
    for rank in range(tp):
        shard = head_shard(heads, kv, tp, rank)
        (ranges,) = qkv_ranges(P.GROUPED_GQA, shard, heads, d, kv)
        local = torch.cat([torch.arange(a, b) for a, b in ranges])
        local = local.view(len(shard.kv), shard.num_q // len(shard.kv) + 2, d)
        assert torch.equal(local[:, :-2].reshape(-1, d), q_rows[shard.q[0]:shard.q[1]])
        assert torch.equal(local[:, -2], k_rows[list(shard.kv)])
        assert torch.equal(local[:, -1], v_rows[list(shard.kv)])


def test_head_shard_more_ranks_than_heads():
    with pytest.raises(TensorParallelError, match=r"use tp_size in \[1, 2\]"):
        head_shard(2, 2, 3, 0)


def test_split_sizes():
    assert split_sizes(101, 3) == [34, 34, 33] and split_sizes(4, 4) == [1, 1, 1, 1]


def test_shard_spec_reads_only_its_slices(tmp_path):
    """The safetensors slice reader and in-memory slicing agree, on both dims, with repeats."""
    full = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    save_file({"w": full}, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    for spec in (ShardSpec(0, ((1, 3), (4, 6))), ShardSpec(1, ((0, 2), (0, 2), (7, 10)))):
        assert torch.equal(reader.read("w", spec), spec.take(full))
    assert ShardSpec(1, ((7, 10),)).take(full).shape == (6, 3)


def test_plan_sources():
    llama = make_model("llama")
    styles, source = linear_styles(
        hf_dsinfer.injection.policies.find_policy(llama), llama.config)
    assert source == "HF base_model_tp_plan" and styles["self_attn.o_proj"] == "rowwise"
    model = make_model("gpt2")
    wrong = dataclasses.replace(gpt2.POLICY, tp_plan={**gpt2.POLICY.tp_plan,
                                                       "attn.c_proj": "colwise"})
    with pytest.raises(TensorParallelError, match="Megatron-style"):
        linear_styles(wrong, model.config)
