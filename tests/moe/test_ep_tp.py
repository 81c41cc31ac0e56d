"""Expert parallelism combined with tensor parallelism: ep=2 x tp=2 on 4 processes (gloo, CPU)
against the single-process HF model, and the MoE tensor-parallel plan.

One torchrun launch runs ep_tp_worker.py over every MoE family (Mixtral 8 experts top-2 and 4
experts top-1, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE's per-head q/k norm,
OLMoE's whole-projection q/k norm, gpt-oss's sinks and biased experts, DeepSeek-V3's latent
attention split by heads), Mixtral with the hierarchical all-to-all, a tp-only
Qwen2-MoE and the size errors; each rank writes a JSON that the tests below assert on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import torchrun
from tiny_models import MOE_2026, MOE_CONFIGS, MOE_MODELS, MOE_VARIANTS, make_model

from hf_dsinfer.injection.layers import iter_layers
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.parallel.plan import kv_owned, linear_styles, plan_block
from hf_dsinfer.parallel.slicing import split_sizes

WORKER = Path(__file__).with_name("ep_tp_worker.py")
WORLD, TP = 4, 2
FP32_LOGIT_ATOL = 1e-4
# every MoE family (the plans of gpt-oss and DeepSeek-V3: tests/parallel/test_tp_plans_2026.py)
TP_MOE_MODELS = [*MOE_MODELS, "ernie4_5_moe_bias"]  # + a biased shared expert
EP_CASES = [*TP_MOE_MODELS, "hier"]
MODELS = [*EP_CASES, "tp_only"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_tp")
    proc = torchrun(WORLD, str(WORKER), str(out), *MODELS, "errors", "from_pretrained")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_ep_tp_matches_one_process(ranks, model):
    for rank, result in enumerate(ranks):
        r = result[model]
        assert r["logit_max_abs"] <= FP32_LOGIT_ATOL, (rank, model, r["logit_max_abs"])
        assert r["batch"] == r["batch_ref"], (rank, model)  # left-padded batch, greedy
        assert r["single"] == r["single_ref"], (rank, model)  # 1 token per decode step
        new = r["new_tokens"]
        assert r["batch"][r["padded_row"]][-new:] == r["single"][0][-new:], (rank, model)
        assert r["tp_ranks"] == [rank - rank % TP, rank - rank % TP + 1]
        # the fused blocks and fused MoE modules ran, as many times in every TP rank
        assert set(r["moe_paths"]) <= set(r["counts"]) and min(r["counts"].values()) > 0
        assert r["counts"] == ranks[rank ^ 1][model]["counts"]
        sharded = r["qk_norm_sharded"]  # OLMoE, MiniMax-M2, FlexOlmo: every block; else none
        assert all(sharded) if model in ("olmoe", "minimax_m2", "flex_olmo") else not any(sharded)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", EP_CASES)
def test_coordinated_all_to_all_over_the_ep_group(ranks, model):
    """Each TP rank sends only its share of the (replicated) tokens, over the EP group of the
    ranks with its TP index; both TP groups keep stepping until the longer generation ends."""
    counts = {tuple(sorted(res[model]["counts"].items())) for res in ranks}
    assert len(counts) == 1, counts  # synced: every rank made every MoE call
    for rank, result in enumerate(ranks):
        r = result[model]
        assert r["ep_ranks"] == [rank % TP, rank % TP + TP]
        moe_calls = [r["counts"][p] for p in r["moe_paths"]]
        assert r["a2a_calls"] == moe_calls == r["gathers"]
        assert r["a2a_row_bytes"] > 0 and "parallelism-coordinated" in r["explain"]
        assert ("hierarchical (1 ranks/node) all-to-all" in r["explain"]) == (model == "hier")
        shares = split_sizes(r["forward_tokens"], TP)
        assert r["share_tokens"] == [shares[rank % TP]] * len(r["moe_paths"])
        experts = _num_experts("mixtral_8x2" if model == "hier" else model)
        assert r["local_experts"] == [experts // 2] * len(r["moe_paths"])


@pytest.mark.multiprocess
def test_sizes_that_do_not_tile_the_world_are_refused(ranks):
    for result in ranks:
        errors = result["errors"]
        assert "8 ranks per model replica must divide the world of 4" in errors["tp2_ep4"]
        assert "use ep_size in [1, 2]" in errors["tp2_ep4"]
        assert "ep_size=2 x tp_size=4" in errors["tp4_ep2"]
        assert errors["tp2_ep4_untouched"] and errors["tp4_ep2_untouched"]


def _num_experts(model: str) -> int:
    config = {**MOE_CONFIGS, **MOE_VARIANTS}[model]()
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, attr, None):
            return getattr(config, attr)
    raise AttributeError(f"{model}: no expert count in its config")


@pytest.mark.parametrize("model", [m for m in MOE_MODELS if m not in MOE_2026])
def test_moe_tp_plan_keeps_experts_whole(model):
    """Attention (and dense / shared-expert MLPs) are sliced; router and experts are not, even
    where HF's base_model_tp_plan slices the experts."""
    m = make_model(model)
    policy = find_policy(m)
    styles, source = linear_styles(policy, m.config)
    assert source == "policy tp_plan"
    assert styles["self_attn.o_proj"] == "rowwise"
    assert not any("experts" in path or path.endswith(".gate") for path in styles)
    for path, index, block in iter_layers(m, policy):
        shard = plan_block(block, policy, m.config, index, TP, 1)
        assert not any("experts" in n or n.startswith("mlp.gate.") for n in shard.params), path
        sliced_mlp = {n for n in shard.params if n.startswith("mlp.")}
        if model == "qwen2_moe":  # layer 1 dense, layers 0 and 2 sparse + shared expert
            prefix = "mlp." if index == 1 else "mlp.shared_expert."
            assert sliced_mlp == {f"{prefix}{n}.weight" for n in ("gate_proj", "up_proj",
                                                                  "down_proj")}
        else:
            assert not sliced_mlp
        norms = {n for n in shard.params if "norm" in n}
        assert norms == ({"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
                         if model == "olmoe" else set())


def test_kv_owned_counts_each_kv_head_once():
    for heads, kv, tp in ((5, 5, 2), (6, 2, 3), (6, 3, 4), (5, 1, 2), (8, 2, 8)):
        total = 0
        for rank in range(tp):
            owned = kv_owned(heads, kv, tp, rank)
            total += sum(owned)
        assert total == kv, (heads, kv, tp)
    assert kv_owned(6, 2, 3, 1) == (False, True)  # heads 2, 3 read KV 0 (rank 0's) and 1


@pytest.mark.multiprocess
def test_from_pretrained_with_tp_and_ep(ranks):
    """A MoE checkpoint whose per-expert tensors transformers merges while loading cannot be read
    as slices: each rank loads it whole (and says so), then slices; same logits as one process."""
    for result in ranks:
        r = result["from_pretrained"]
        assert r["warned_whole_load"]
        assert r["logit_max_abs"] <= FP32_LOGIT_ATOL, r["logit_max_abs"]
        assert min(r["counts"].values()) > 0
        assert r["local_experts"] == [4] * len(r["local_experts"])  # 8 experts over ep=2
