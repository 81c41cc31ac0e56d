"""Launched by test_pipeline_parallel.py: `torchrun --nproc-per-node W pp_worker.py OUT DIR PP
MODE FAMILY...` (or the same under `accelerate launch`): pipeline parallelism on every family named, in one launch, then a stage of the
first family failing in MODE ("raise" or "silent"). A family named `name` runs with tp = W / PP,
`name@ep` with ep = W / PP (each stage's experts sharded over the stage's ranks).

Each family is built with 4 decoder layers (so 2 and 3 stages both split it), saved once to
DIR, and loaded with `from_pretrained(dir, dsinfer={"pp_size": PP, "tp_size": TP})`; every rank
also runs HF eager on the same model in-process and compares. Each rank writes its own JSON
(`OUT.<rank>.json`); the pytest side asserts. The failure checks come last: after them the
process group is not used again.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "..")]  # tiny_models, and this checkout's package

import torch
import torch.distributed as dist
from launch import exit_skipping_teardown
from tiny_models import CONFIGS, MOE_CONFIGS, prompts
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_dsinfer
from hf_dsinfer.errors import DSInferError, PipelineParallelError
from hf_dsinfer.injection.walker import get_report

LAYERS = 4
NEW = 6
GEN = {"max_new_tokens": NEW, "pad_token_id": 0}
SAMPLE = {"do_sample": True, "top_k": 20, "temperature": 0.9}


def deep_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny test model of `name` with LAYERS decoder layers (layer-type patterns repeated)."""
    config = {**CONFIGS, **MOE_CONFIGS}[name]()
    old = config.num_hidden_layers
    for key, value in list(vars(config).items()):  # per-layer lists: layer_types, no_rope_layers
        if isinstance(value, list) and len(value) == old:
            setattr(config, key, [value[i % old] for i in range(LAYERS)])
    config.num_hidden_layers = LAYERS
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = [1]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


class Recorder(BaseStreamer):
    """A streamer that keeps what generate puts (the prompt, then each new token)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.tokens += value.reshape(-1).tolist()

    def end(self) -> None:
        self.ended = True


def _tokens(model, ids, mask, seed: int, **kwargs) -> list[list[int]]:
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **GEN, **kwargs).tolist()


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


def _shared_bytes(model, report) -> int:
    """Weights outside the decoder layers, the embedding and lm_head (final norm, position
    embeddings, OPT's projections): every stage holds them."""
    layers = model.get_submodule(report.pp.layers_path)
    skip = {id(p) for m in (layers, model.get_input_embeddings(), model.get_output_embeddings())
            for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def layout(spec: str, world: int, pp: int) -> tuple[str, int, int]:
    """(family, tp, ep) of a family spec: "name" (tp = world / pp), "name@ep" (ep = world /
    pp: each stage's experts sharded over its ranks) or "name@tp2ep" (tp = 2, ep = the rest)."""
    name, _, how = spec.partition("@")
    if how == "tp2ep":  # tp = 2 inside each stage, the rest expert-parallel
        return name, 2, world // pp // 2
    return (name, 1, world // pp) if how == "ep" else (name, world // pp, 1)


def _a2a_calls(report) -> int:
    return 0 if report.ep is None else sum(m.parallel.stats.calls for m in report.ep.moes.values())


def check_family(spec: str, folder: str, pp: int, world: int, rank: int, first: bool) -> dict:
    """Logits and greedy tokens of a left-padded batch; for the first family and the MoE ones
    also early EOS and seeded sampling; for the first, the schedule variants too."""
    name, tp, ep = layout(spec, world, pp)
    ref = deep_model(name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dsinfer={"pp_size": pp, "tp_size": tp, "ep_size": ep})
    report = get_report(model)
    ids, mask = prompts(batch=3)
    with torch.inference_mode():
        hf_logits = ref(ids, attention_mask=mask).logits
        before = sum(hf_dsinfer.fused_call_counts(model).values()), _a2a_calls(report)
        pp_logits = model(ids, attention_mask=mask).logits
        fused_ran = sum(hf_dsinfer.fused_call_counts(model).values()) > before[0]
        a2a_ran = _a2a_calls(report) > before[1]
    greedy_hf = _tokens(ref, ids, mask, 0)
    # An EOS that row 0 emits early: rows then finish at different steps and leave their
    # micro-batches while the others go on.
    eos = greedy_hf[0][ids.shape[1] + 1]
    out = {
        "logits_max_diff": (hf_logits - pp_logits)[mask.bool()].abs().max().item(),
        "fused_ran": fused_ran,
        "loaded_sharded": report.pp.loaded_sharded,
        "expert_reads": report.pp.plan.expert_reads,
        "tp": tp,
        "ep": ep,
        "a2a_ran": a2a_ran,  # the stage's MoE layers went through the expert all-to-all
        "explain_ep": "\n".join(line for line in hf_dsinfer.explain(model).splitlines()
                                if "expert parallel" in line),
        "local_experts": None if report.ep is None else [
            [m.experts.gate_up_proj.shape[0], m.spec.num_experts]
            for m in report.ep.moes.values()],
        "own_blocks": sorted(report.blocks),
        "parity": {k: [r.max_rel_err, r.passed] for k, r in report.parity.items()},
        "stage": report.pp.ranks.stage,
        "held_bytes": _bytes(model),
        "planned_bytes": report.pp.plan.stage_bytes[report.pp.ranks.stage],
        "full_bytes": _bytes(ref),
        "shared_bytes": _shared_bytes(ref, report),
        "tokens": {"greedy": [greedy_hf, _tokens(model, ids, mask, 0)]},
    }
    if ep > 1:  # a loaded model split in place (init_inference) rather than read per stage
        split = hf_dsinfer.init_inference(deep_model(name), pp_size=pp, tp_size=tp, ep_size=ep)
        out["tokens"]["init_inference"] = [greedy_hf, _tokens(split, ids, mask, 0)]
        out["split_loaded_sharded"] = get_report(split).pp.loaded_sharded
    if first or name in MOE_CONFIGS:
        out["tokens"].update({
            "eos": [_tokens(ref, ids, mask, 0, eos_token_id=eos),
                    _tokens(model, ids, mask, 0, eos_token_id=eos)],
            "sample": [_tokens(ref, ids, mask, 1234, **SAMPLE),
                       _tokens(model, ids, mask, 1234 + 17 * rank, **SAMPLE)]})
    if first:  # schedule variants, once per launch
        streamer = Recorder()
        with torch.inference_mode():
            streamed = _tokens(model, ids[:1], mask[:1], 0, streamer=streamer)
        out["streamed"] = [streamed[0], streamer.tokens]
        five, five_mask = prompts(batch=5, lengths=(9, 5, 7, 3, 8))
        out["tokens"].update({
            "one_row": [_tokens(ref, ids[:1], mask[:1], 0), streamed],
            "sample_eos_five_rows": [
                _tokens(ref, five, five_mask, 99, eos_token_id=eos, **SAMPLE),
                _tokens(model, five, five_mask, 99 + rank, eos_token_id=eos, **SAMPLE)],
            "lockstep": [greedy_hf, _tokens(model, ids, mask, 0, pp_schedule="lockstep")],
            "one_micro_batch": [greedy_hf, _tokens(model, ids, mask, 0, pp_micro_batches=1,
                                                   pp_prompt_micro_batches=1)],
            "row_micro_batches": [greedy_hf, _tokens(model, ids, mask, 0, pp_micro_batches=3)]})
        semantics = check_generate_semantics(ref, model, ids, mask, eos, rank)
        out["tokens"].update(semantics.pop("tokens"))
        out.update(semantics)
        out["explain"] = hf_dsinfer.explain(model)
        out["refused"] = []
        for call in (lambda: model.save_pretrained(folder + "-copy"),
                     lambda: model.generate_batch(inputs=[[5, 6, 7]])):
            try:
                call()
            except DSInferError as err:  # tensor parallelism's own refusal under tp > 1
                out["refused"].append(str(err))
    return out


class EveryThird(StoppingCriteria):
    """A row-wise custom criterion: a row stops at a token divisible by 3."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] % 3 == 0


def check_generate_semantics(ref, model, ids, mask, eos: int, rank: int) -> dict:
    """HF's generate() contract beyond tokens: scores and raw logits per step (greedy with an
    early EOS, and sampling), a custom row-wise stopping criterion with and without EOS (without
    it, HF's finished rows go on generating real tokens), and max_time."""
    out: dict = {"tokens": {}, "outputs": {}}
    scored = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    for case, seed, extra in (("scores_greedy_eos", 0, {"eos_token_id": eos}),
                              ("scores_sample", 5, SAMPLE)):
        torch.manual_seed(seed)
        hf = ref.generate(ids, attention_mask=mask, **GEN, **scored, **extra)
        torch.manual_seed(seed + rank)
        pp = model.generate(ids, attention_mask=mask, **GEN, **scored, **extra)
        out["schedule_with_scores"] = _pipelined(model).last_stats["schedule"]
        out["tokens"][case] = [hf.sequences.tolist(), pp.sequences.tolist()]
        out["outputs"][case] = {
            name: [len(getattr(hf, name)), len(getattr(pp, name)),
                   max(_diff(a, b) for a, b in zip(getattr(hf, name), getattr(pp, name)))]
            for name in ("scores", "logits")}
    stop = {"stopping_criteria": StoppingCriteriaList([EveryThird()])}
    out["tokens"]["custom_stop_eos"] = [_tokens(ref, ids, mask, 0, **stop),
                                        _tokens(model, ids, mask, 0, **stop)]
    out["tokens"]["custom_stop_no_eos"] = [_tokens(ref, ids, mask, 0, eos_token_id=None, **stop),
                                           _tokens(model, ids, mask, 0, eos_token_id=None, **stop)]
    out["tokens"]["max_time"] = [_tokens(ref, ids, mask, 0, max_time=1e-6),
                                 _tokens(model, ids, mask, 0, max_time=1e-6)]
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|, entries equal in both (top-k's -inf) counting 0."""
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


def _pipelined(model):
    """The PipelinedGenerate under tensor parallelism's RNG wrapper, if any."""
    generate = model.generate
    return generate if hasattr(generate, "last_stats") else generate.generate


TIMEOUT_S = 1.0


def check_failures(folder: str, pp: int, tp: int, ep: int, rank: int, mode: str) -> dict:
    """Stage 1 raises ("raise": every rank must raise at once) or goes silent for longer than
    pp_timeout_s ("silent": the others must raise after about that long), at its 3rd forward."""
    out = {}
    model = AutoModelForCausalLM.from_pretrained(
        folder, dsinfer={"pp_size": pp, "tp_size": tp, "ep_size": ep, "pp_timeout_s": TIMEOUT_S})
    ids, mask = prompts(batch=3)
    fused = next(iter(get_report(model).blocks.values()))
    if rank // (tp * ep) == 1:
        calls = {"n": 0}
        inner = fused.block.forward

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3 and mode == "raise":
                raise RuntimeError("injected failure on stage 1")
            if calls["n"] == 3:
                time.sleep(2.5 * TIMEOUT_S)
            return inner(*args, **kwargs)

        fused.block.forward = failing
    start = time.perf_counter()
    try:
        model.generate(ids, attention_mask=mask, **GEN)
        out["raised"] = None
    except (PipelineParallelError, RuntimeError) as err:
        out["raised"] = f"{type(err).__name__}: {err}"
    out["seconds"] = time.perf_counter() - start
    return out


def main() -> None:
    out_path, root, pp, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    families = sys.argv[5:]
    torch.set_num_threads(1)
    launcher = "accelerate" if "ACCELERATE_MIXED_PRECISION" in os.environ else "torchrun"
    if launcher == "accelerate":  # accelerate's own state sets the process group up
        from accelerate import PartialState

        PartialState(cpu=True)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted({layout(spec, world, pp)[0] for spec in families})
    if rank == 0:
        for name in names:
            deep_model(name).save_pretrained(os.path.join(root, name))
    dist.barrier()
    result: dict = {"world": world, "pp": pp, "launcher": launcher,
                    "backend": dist.get_backend(), "families": {}}
    try:
        for spec in families:
            folder = os.path.join(root, layout(spec, world, pp)[0])
            result["families"][spec] = check_family(spec, folder, pp, world, rank,
                                                    first=spec == families[0])
        first, tp, ep = layout(families[0], world, pp)
        result["width"] = tp * ep  # ranks per stage
        result["failure"] = check_failures(os.path.join(root, first), pp, tp, ep, rank, mode)
    except Exception:  # noqa: BLE001  (into the JSON: the pytest side shows the traceback)
        result["crash"] = traceback.format_exc()
    with open(f"{out_path}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
