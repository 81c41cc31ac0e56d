"""Pipeline parallelism (issue 28) against HF eager in one process.

Three launches (pp=2 under `accelerate launch`, the others under torchrun) run pp_worker.py (each family at 4 layers, loaded with
`from_pretrained(dir, dsinfer={"pp_size": P, "tp_size": T, "ep_size": E})`, each rank reading
only its stage, per-expert MoE tensors included):
- pp=2: every dense family and Mixtral; a stage that raises;
- pp=3: Llama and Mixtral; a stage that goes silent;
- 4 processes: tp=2 x pp=2 on Llama and Mixtral, ep=2 x pp=2 on Mixtral and Qwen2-MoE (each
  stage's experts sharded over its two ranks); a stage that raises.
Each rank compares with HF on the same model in-process: fp32 logits of a left-padded batch
through the lock-step forward and greedy tokens of the left-padded batch (every family); for
Llama and the MoE family also an EOS that makes rows finish at different steps (they leave
their micro-batches) and seeded sampling with every rank seeded differently (the pipeline
starts from rank 0's RNG state); for Llama one row, five rows with sampling and early EOS, the
lock-step baseline schedule, one micro-batch, one micro-batch per row, a streamer, scores and
logits returned by generate, a custom row-wise stopping criterion with and without EOS, and
max_time; for the ep families also the model split in place by init_inference. (tp=2 x ep=2 x
pp=2 runs in the same worker by hand: see docs/parallelism.md.)
Logits and the streamed call run under torch.inference_mode(), the rest under generate's
no_grad. The in-process tests cover the stage partition,
the cache redirection, the sampling order and the errors that need no second process.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from launch import accelerate_launch, torchrun
from tiny_models import FAMILIES, MOE_2026, MOE_CONFIGS, make_model
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
)

import hf_dsinfer
from hf_dsinfer.errors import PipelineParallelError
from hf_dsinfer.parallel.pipeline import bind_stage_cache, partition
from hf_dsinfer.parallel.pipeline_generate import DrawLedger

WORKER = Path(__file__).with_name("pp_worker.py")
FP32_LOGIT_ATOL = 1e-4
MOE = "mixtral_8x2"
LAUNCHES = {  # name: (processes, pp, failure mode, families; "name@ep": ep = processes / pp)
    # under `accelerate launch` (examples/accelerate/pp2_one_node.yaml), the others torchrun
    "pp2": (2, 2, "raise", ["llama", *[f for f in FAMILIES if f != "llama"], MOE, *MOE_2026]),
    "pp3": (3, 3, "silent", ["llama", MOE]),
    # tp=2 x pp=2 and ep=2 x pp=2 in one launch (start-up is the expensive part)
    "x2pp2": (4, 2, "raise", ["llama", MOE, f"{MOE}@ep", "qwen2_moe@ep"]),
}
ACCELERATE = {"pp2": Path(__file__).resolve().parents[2] / "examples" / "accelerate" /
              "pp2_one_node.yaml"}
TIMEOUT_S = 1.0  # pp_worker.TIMEOUT_S
# layer 0 dense, the others MoE: their 4 layers do not split in halves
UNEVEN = {"deepseek_v3", "deepseek_v2", "glm4_moe", "ernie4_5_moe", "dots1"}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def run(request, tmp_path_factory):
    procs, pp, mode, families = LAUNCHES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    args = (str(WORKER), str(out / "result"), str(out), str(pp), mode, *families)
    if request.param in ACCELERATE:
        proc = accelerate_launch(str(ACCELERATE[request.param]), procs, *args)
    else:
        proc = torchrun(procs, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"result.{r}.json").read_text()) for r in range(procs)]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    return ranks


def _families(run):
    return list(run[0]["families"])


@pytest.mark.multiprocess
def test_logits_match_single_process(run):
    for name in _families(run):
        for rank in run:
            fam = rank["families"][name]
            assert fam["fused_ran"], name  # this rank's own fused blocks computed
            assert fam["loaded_sharded"], name  # it read only its stage from the checkpoint
            if name == MOE or (fam["expert_reads"] and fam["ep"] == 1):  # per-expert tensors
                assert fam["expert_reads"][0] == fam["expert_reads"][1] > 0, name
            assert fam["logits_max_diff"] <= FP32_LOGIT_ATOL, (name, fam["logits_max_diff"])
            assert fam["parity"] and all(ok for _, ok in fam["parity"].values()), fam["parity"]


@pytest.mark.multiprocess
def test_tokens_identical_to_single_process(run):
    for name in _families(run):
        for rank in run:
            for case, (hf, pp) in rank["families"][name]["tokens"].items():
                assert hf == pp, (name, case, rank["families"][name]["stage"])
    assert "lockstep" in run[0]["families"][_families(run)[0]]["tokens"]
    assert all("sample" in run[0]["families"][name]["tokens"] for name in (_families(run)[0],
                                                                          *_moe(run)))


def _moe(run):
    return [name for name in _families(run) if name.partition("@")[0] in MOE_CONFIGS]


@pytest.mark.multiprocess
def test_launched_as_users_launch(run):
    """pp=2 ran under `accelerate launch` (accelerate's PartialState made the gloo group), the
    others under torchrun: the parity checks above hold under both launchers."""
    want = "accelerate" if run[0]["world"] == 2 else "torchrun"
    assert all(rank["launcher"] == want and rank["backend"] == "gloo" for rank in run)


@pytest.mark.multiprocess
def test_generate_returns_scores_and_logits(run):
    """return_dict_in_generate with output_scores / output_logits: one [batch, vocab] tensor per
    generated step on every rank, equal to HF's (rows that finished early keep HF's scores:
    they stay in their micro-batch, under the lock-step schedule). The custom-criterion and
    max_time token cases are in test_tokens_identical_to_single_process."""
    for rank in run:
        fam = rank["families"][_families(run)[0]]
        assert fam["schedule_with_scores"] == "lockstep"
        for case, outputs in fam["outputs"].items():
            for name, (hf_steps, pp_steps, diff) in outputs.items():
                assert hf_steps == pp_steps == 6, (case, name)
                assert diff <= FP32_LOGIT_ATOL, (case, name, diff)
        assert {"custom_stop_eos", "custom_stop_no_eos", "max_time"} <= set(fam["tokens"])


@pytest.mark.multiprocess
def test_streamer_runs_on_the_last_stage(run):
    """The prompt, then every new token; other stages' streamers get nothing."""
    for rank in run:
        fam = rank["families"][_families(run)[0]]
        generated, streamed = fam["streamed"]
        last = fam["stage"] == rank["pp"] - 1
        assert streamed == (generated if last else []), fam["stage"]


@pytest.mark.multiprocess
def test_stages_hold_their_layers_only(run):
    pp = run[0]["pp"]
    for name in _families(run):
        fams = [rank["families"][name] for rank in run]
        tp, ep = fams[0]["tp"], fams[0]["ep"]
        owned = sorted(b for f in fams[::tp * ep] for b in f["own_blocks"])
        assert len(owned) == 4 and len(set(owned)) == 4  # every layer on exactly one stage
        full = fams[0]["full_bytes"]
        for f in fams:
            # a rank holds its planned layers (and embedding / lm_head), its tensor-parallel
            # slice of them under tp > 1 (its experts under ep > 1), and the small modules
            # every stage runs (final norm, position embeddings, OPT's projections)
            if tp == ep == 1:
                assert f["held_bytes"] == f["planned_bytes"] + f["shared_bytes"], name
            else:
                assert f["held_bytes"] < f["planned_bytes"] + f["shared_bytes"], name
            if pp == 2 and tp == ep == 1 and name not in UNEVEN:  # half of the weights each
                share = (f["held_bytes"] - f["shared_bytes"]) / (full - f["shared_bytes"])
                assert abs(share - 0.5) < 0.05, (name, f["held_bytes"], full)


@pytest.mark.multiprocess
def test_experts_sharded_over_each_stage(run):
    """ep=2 x pp=2: every stage's MoE layers keep half of the experts on each of its ranks, the
    two ranks of a stage hold different halves, and the lock-step forward ran the all-to-all."""
    for name in [n for n in _families(run) if n.endswith("@ep")]:
        fams = [rank["families"][name] for rank in run]
        assert fams[0]["ep"] == 2 and fams[0]["tp"] == 1
        for f in fams:
            assert f["a2a_ran"], name
            assert f["local_experts"] and all(2 * held == total
                                              for held, total in f["local_experts"]), name
            read, stage_has = f["expert_reads"]  # only its share of the per-expert tensors
            assert stage_has > 0 and 2 * read == stage_has, (name, f["expert_reads"])
            assert "init_inference" in f["tokens"] and not f["split_loaded_sharded"]
        stages = {f["stage"] for f in fams}
        assert stages == {0, 1} and fams[0]["stage"] == fams[1]["stage"] == 0
        assert "expert parallel: rank 0/2" in fams[0]["explain_ep"]
        assert "expert parallel: rank 1/2" in fams[1]["explain_ep"]
    if run[0]["world"] == 4:
        assert any(n.endswith("@ep") for n in _families(run))


@pytest.mark.multiprocess
def test_explain_names_the_stages(run):
    text = run[0]["families"][_families(run)[0]]["explain"]
    assert "pipeline parallel: stage 0 of" in text and "stage 1: layers" in text
    assert "held by pipeline stage" in text
    refused = run[0]["families"][_families(run)[0]]["refused"]
    assert len(refused) == 2 and "save_pretrained" in refused[0]


@pytest.mark.multiprocess
def test_failing_stage_makes_every_rank_raise(run):
    width, failure = run[0]["width"], [rank["failure"] for rank in run]
    for r, result in enumerate(failure):
        assert result["raised"] is not None, r
        if r // width == 1 and "injected" in result["raised"]:
            continue  # the failing stage raises its own error
        assert result["raised"].startswith("PipelineParallelError"), result
        assert result["seconds"] < 3 * TIMEOUT_S + 2, result


# -- in-process ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("costs", "stages", "first", "last", "heaviest", "expected"), [
    ([1, 1, 1, 1], 2, 0, 0, 2, [(0, 2), (2, 4)]),
    ([1, 1, 1, 1], 3, 0, 0, 2, None),                   # 2+1+1, 1+2+1 or 1+1+2
    ([1, 1, 1, 1], 2, 2, 0, 3, [(0, 1), (1, 4)]),       # the embedding weighs on stage 0
    ([1, 1, 1, 1], 2, 0, 2, 3, [(0, 3), (3, 4)]),       # lm_head on the last
    ([5, 1, 1, 1, 1, 1], 2, 0, 0, 5, [(0, 1), (1, 6)]),  # one heavy layer
    ([3, 3, 3], 3, 0, 0, 3, [(0, 1), (1, 2), (2, 3)]),
    # by hand: 1+2+7 | 1+1+4 | 2+3+1 (or 1+2 | 7+1+1 | 4+2+3+1): the heaviest stage is 10
    ([2, 7, 1, 1, 4, 2, 3], 3, 1, 1, 10, None),
])
def test_partition_by_bytes(costs, stages, first, last, heaviest, expected):
    got = partition(costs, stages, first, last)
    assert got[0].start == 0 and got[-1].stop == len(costs) and all(len(r) for r in got)
    assert all(a.stop == b.start for a, b in itertools.pairwise(got))
    loads = [sum(costs[i] for i in r) for r in got]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == heaviest
    if expected is not None:
        assert [(r.start, r.stop) for r in got] == expected


def test_partition_needs_a_layer_per_stage():
    with pytest.raises(PipelineParallelError, match="use pp_size <= 2"):
        partition([1, 1], 3)


@pytest.mark.parametrize("bad", [
    {"pp_size": 0}, {"pp_size": True}, {"pp_size": 2, "compile": True},
    {"pp_size": 2, "cache": "static"},
    {"pp_micro_batches": 0}, {"pp_micro_batches": 3, "pp_prompt_micro_batches": 2},
    {"pp_timeout_s": -1},
])
def test_config_validated(bad):
    with pytest.raises(ValueError, match="pp_"):
        hf_dsinfer.DSInferConfig(**bad)


def test_no_process_group_raises(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = make_model("llama")
    with pytest.raises(hf_dsinfer.errors.DSInferError, match="needs a torch.distributed"):
        hf_dsinfer.init_inference(model, pp_size=2)


def test_pipeline_combines_with_ep_and_tp_in_the_config():
    config = hf_dsinfer.DSInferConfig(pp_size=2, ep_size=2, tp_size=2)
    assert (config.pp_size, config.ep_size, config.tp_size) == (2, 2, 2)


def test_nccl_refusal_says_why_and_what_works(monkeypatch):
    """No GPU here: NCCL pipelines stay refused, and the error says so and what runs instead."""
    from hf_dsinfer.parallel import pipeline

    monkeypatch.setattr(pipeline, "ensure_world", lambda what: 4)
    monkeypatch.setattr(pipeline.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(PipelineParallelError) as err:
        pipeline.pipeline_ranks(2, 1, 1.0, ep=2)
    text = str(err.value)
    assert "'nccl' backend" in text and "no GPU to verify it on" in text
    assert "What works instead" in text and "init_process_group('gloo')" in text
    with pytest.raises(PipelineParallelError, match=r"tp_size \* ep_size \* pp_size"):
        pipeline.pipeline_ranks(2, 1, 1.0, ep=1)  # 2 stages of 1 rank: a world of 4 is wrong


@pytest.mark.parametrize("name", ["mixtral_8x2", "qwen2_moe", "deepseek_v3"])
def test_stacked_expert_reads_equal_transformers_loading(name, tmp_path):
    """Per-expert checkpoint tensors stacked by our reader are the parameters transformers'
    own loader builds (so a pipeline stage can read only its own MoE layers)."""
    from transformers import AutoModelForCausalLM

    from hf_dsinfer.parallel.loading import CheckpointReader
    from hf_dsinfer.parallel.stacked_experts import STACKED, stacked_keys

    make_model(name).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    keys, reader = stacked_keys(loaded, CheckpointReader(tmp_path))
    params = loaded.state_dict()
    assert set(keys) == set(params)
    stacked = [n for n, k in keys.items() if k.startswith(STACKED)]
    assert stacked and all(params[n].dim() == 3 for n in stacked)
    for n, key in keys.items():
        assert torch.equal(reader.read(key, None).to(params[n].dtype), params[n]), n


class _RowWise(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 7


@pytest.mark.parametrize(("criteria", "outputs", "keep"), [
    ([MaxLengthCriteria(9)], {}, False),
    ([MaxLengthCriteria(9), MaxTimeCriteria(5.0)], {}, False),  # stop every row at once
    ([MaxLengthCriteria(9), EosTokenCriteria(2)], {}, False),  # finished rows: padding
    ([MaxLengthCriteria(9), _RowWise()], {}, True),  # HF's finished rows go on generating
    ([MaxLengthCriteria(9), EosTokenCriteria(2), _RowWise()], {}, False),
    ([MaxLengthCriteria(9)], {"output_scores": True}, True),  # a score for every row
    ([MaxLengthCriteria(9)], {"output_logits": True}, True),
    ([MaxLengthCriteria(9)], {"output_scores": True, "return_dict_in_generate": False}, False),
])
def test_rows_stay_when_hf_would_keep_them(criteria, outputs, keep):
    """Rows leave their micro-batch only where HF's loop gives them nothing more than padding;
    where they stay, the schedule is lock-step (the batch's end is known at every step)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hf_dsinfer.parallel.pipeline_generate import ScheduleLoop

    loop = ScheduleLoop(SimpleNamespace(ranks=None), hf_dsinfer.DSInferConfig(), "dynamic", None)
    gen = GenerationConfig(**{"return_dict_in_generate": True, **outputs})
    loop._choose_row_policy(gen, StoppingCriteriaList(criteria))
    assert loop.keep_rows is keep
    assert loop.schedule == ("lockstep" if keep else "dynamic")
    assert loop.want == [n for f, n in (("output_scores", "scores"), ("output_logits", "logits"))
                         if outputs.get(f) and outputs.get("return_dict_in_generate", True)]


def test_refused_methods_say_why():
    from hf_dsinfer.parallel.pipeline import RefusedUnderPipeline

    for name in RefusedUnderPipeline.FIXES:
        with pytest.raises(PipelineParallelError, match=f"{name} on a pipeline-parallel model"):
            RefusedUnderPipeline(name, 1)()


def test_stage_cache_reads_its_own_layers():
    """Layer 0 lives on another stage and stays empty; lengths come from the stage's layers."""
    model = make_model("gemma3_text")  # sliding, full, sliding
    cache = DynamicCache(config=model.config)
    bind_stage_cache(cache, range(1, 3))
    k = torch.zeros(2, 3, 7, 16)
    cache.update(k, k, 1)
    cache.update(k, k, 2)
    assert cache.get_seq_length() == 7 and cache.layers[0].get_seq_length() == 0
    assert cache.get_mask_sizes(1, 0) == cache.layers[2].get_mask_sizes(1)  # sliding -> 2
    assert cache.get_mask_sizes(1, 1) == (8, 0)


def test_draw_ledger_draws_in_single_process_order():
    """Micro-batches drawing in order, with stand-ins for rows and micro-batches that left,
    give the tokens of one multinomial over the whole batch per step."""
    probs = torch.softmax(torch.randn(3, 5, 50), -1)  # [step, row, vocab]
    torch.manual_seed(0)
    want = [torch.multinomial(probs[t], 1).squeeze(1) for t in range(3)]
    torch.manual_seed(0)
    got = [torch.multinomial(probs[0], 1).squeeze(1)]  # the prompt step
    ledger = DrawLedger([2, 3])  # rows 0-1 and 2-4
    # step 1: both micro-batches; step 2: the first has left, the second lost its row 3
    got.append(torch.cat([ledger.draw(1, 0, probs[1, :2], torch.arange(2)),
                          ledger.draw(1, 1, probs[1, 2:], torch.arange(3))]))
    kept = torch.tensor([0, 2])
    got.append(ledger.draw(2, 1, probs[2, 2:][kept], kept))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2][2:][kept])
