"""Launched by test_tensor_parallel.py: `torchrun --nproc-per-node N tp_worker.py OUT.json DIR`.

One launch per world size checks every dense family, gpt-oss and DeepSeek-V3, and writes what it measured as JSON (rank
0 writes; every rank's tokens are gathered into it); the pytest side asserts. Each family is
saved once to DIR and loaded with `from_pretrained(dir, dsinfer={"tp_size": N})` (sharded
loading: meta model + this rank's safetensors slices + the tensor-parallel parity gate); the
in-place path (`init_inference(model, tp_size=N)` on a full model) is checked too.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch.distributed as dist
from launch import exit_skipping_teardown
from tiny_models import FAMILIES, MOE_2026, make_model, prompts
from transformers import AutoModelForCausalLM, GPT2Config

import hf_dsinfer
from hf_dsinfer.errors import TensorParallelError
from hf_dsinfer.injection.parity import run_parity_gate
from hf_dsinfer.parallel.parity import build_references

NEW_TOKENS = 16
GEN = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "pad_token_id": 0}


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


def _calls(model) -> int:
    return sum(hf_dsinfer.fused_call_counts(model).values())


def _generate(model, ids, mask, seed: int, **kwargs) -> list[list[int]]:
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **GEN, **kwargs).tolist()


def local_attention(report) -> dict:
    """What each block computes with on this rank: its query heads (MLA: the latent attention's),
    gpt-oss's sink logits, and the absorbed MLA decode steps so far."""
    blocks = list(report.blocks.values())
    out = {"num_heads": [f.spec.num_heads for f in blocks]}
    if blocks[0].mla is not None:
        out["mla_heads"] = [f.mla.spec.num_heads for f in blocks]
        out["absorbed_calls"] = sum(f.mla.absorbed_calls for f in blocks)
    if blocks[0].spec.sinks:
        out["sinks"] = [f._attn.sinks.shape[0] for f in blocks]
    return out


def check_family(name: str, folder: str, tp: int, rank: int) -> dict:
    ref = make_model(name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dsinfer={"tp_size": tp})
    in_place = hf_dsinfer.init_inference(copy.deepcopy(ref), tp_size=tp)
    report = hf_dsinfer.injection.walker.get_report(loaded)
    ids, mask = prompts(batch=3)
    with torch.no_grad():
        hf_logits = ref(ids, attention_mask=mask).logits
        before = _calls(loaded)
        tp_logits = loaded(ids, attention_mask=mask).logits
        fused_ran = _calls(loaded) > before
        in_place_logits = in_place(ids, attention_mask=mask).logits
    one, one_mask = prompts(batch=1)
    sample = {"do_sample": True, "top_k": 20, "temperature": 0.9}
    # Each rank seeds differently: only the group's RNG sync makes them draw the same tokens,
    # which must then be the tokens of a single process seeded like the first rank.
    out = {
        "logits_max_diff": _max_diff(hf_logits, tp_logits, mask),
        "in_place_logits_max_diff": _max_diff(hf_logits, in_place_logits, mask),
        "fused_ran": fused_ran,
        "parity": {k: [r.max_rel_err, r.passed] for k, r in report.parity.items()},
        "heads": [list(report.tp.plan.blocks[p].heads.q) + [list(report.tp.plan.blocks[p].heads.kv)]
                  for p in list(report.tp.plan.blocks)[:1]],
        "greedy_hf": _generate(ref, one, one_mask, 0, do_sample=False),
        "greedy_tp": _generate(loaded, one, one_mask, 0, do_sample=False),
        "local": local_attention(report),  # after a prefill and 15 one-token steps
        "loaded_sharded": report.tp.loaded_sharded,
        "batch_hf": _generate(ref, ids, mask, 0, do_sample=False),
        "batch_tp": _generate(loaded, ids, mask, 0, do_sample=False),
        "static_tp": _generate(loaded, ids, mask, 0, do_sample=False,
                               cache_implementation="static"),
        "sample_hf": _generate(ref, ids, mask, 1234, **sample),
        "sample_tp": _generate(loaded, ids, mask, 1234 + 17 * rank, **sample),
    }
    return out


def check_parity_gate_can_fail(folder: str, tp: int) -> dict:
    """References built from *other* weights must fail the tensor-parallel gate."""
    loaded = AutoModelForCausalLM.from_pretrained(folder, dsinfer={"tp_size": tp})
    report = hf_dsinfer.injection.walker.get_report(loaded)
    other = make_model("bloom", seed=7)
    blocks = [("transformer.h.0", other.transformer.h[0])]
    refs = build_references(other, report.policy, lambda n: other.get_parameter(n).detach(), blocks)
    return {k: [r.max_rel_err, r.passed] for k, r in run_parity_gate(loaded, report.blocks, refs).items()}


def check_errors(tp: int, world: int) -> dict:
    """Bad input must raise a clear error at init on every rank (never hang)."""
    cases = {
        "tp_larger_than_world": lambda: hf_dsinfer.init_inference(make_model("gpt2"),
                                                                  tp_size=world + 1),
        "heads_unsplittable": lambda: hf_dsinfer.init_inference(
            AutoModelForCausalLM.from_config(GPT2Config(
                n_embd=32, n_head=tp - 1, n_layer=1, vocab_size=50)), tp_size=tp),
    }
    if world % 2:
        cases["tp_not_dividing_world"] = lambda: hf_dsinfer.init_inference(make_model("gpt2"),
                                                                           tp_size=2)
    cases["save_pretrained_of_a_shard"] = lambda: hf_dsinfer.init_inference(
        make_model("gpt2"), tp_size=tp).save_pretrained(os.path.join(tempfile.gettempdir(), "refused-before-writing"))
    out = {}
    for key, fn in cases.items():
        try:
            fn()
            out[key] = None
        except TensorParallelError as exc:
            out[key] = str(exc)
    return out


def main() -> None:
    out_path, root = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    families = sys.argv[3:] or FAMILIES + MOE_2026
    if rank == 0:
        for name in families:
            make_model(name).save_pretrained(os.path.join(root, name))
    dist.barrier()
    result: dict = {"world": world, "families": {}, "errors": {}}
    try:
        for name in families:
            result["families"][name] = check_family(name, os.path.join(root, name), world, rank)
        if "bloom" in families:
            result["gate_with_wrong_reference"] = check_parity_gate_can_fail(
                os.path.join(root, "bloom"), world)
        result["errors"] = check_errors(world, world)
    except Exception:  # noqa: BLE001  (into the JSON: the pytest side shows the traceback)
        result["crash"] = traceback.format_exc()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
