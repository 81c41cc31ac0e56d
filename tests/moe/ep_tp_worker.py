"""Run under `torchrun --nproc-per-node 4 ep_tp_worker.py OUT_DIR CASE...`: expert parallelism
(ep=2) combined with tensor parallelism (tp=2) against the same model in one process, one JSON
per rank.

TP groups are ranks {0, 1} and {2, 3}; EP groups the ranks with the same TP index, {0, 2} and
{1, 3}. Both ranks of a TP group feed the same prompts (tensor parallelism needs it); the two TP
groups feed different prompts and ask for different numbers of new tokens, so one group keeps
stepping (and joining the all-to-alls) after the other has finished. The batches have odd token
counts (tokens % tp != 0) and a 1-prompt generation decodes 1 token per step (one TP rank sends
nothing through the all-to-all). Cases are model names from tiny_models.MOE_CONFIGS, plus:
    hier         Mixtral 8x top-2 with the hierarchical all-to-all (ep_node_size=1)
    tp_only      Qwen2-MoE with tp=2, ep=1: experts replicated, shared expert tensor-sliced
    errors       sizes that do not tile the world are refused on every rank, at init
    from_pretrained  a saved Mixtral loaded with dsinfer={"tp_size": 2, "ep_size": 2}
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ep_worker import worker_main
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.errors import ExpertParallelError
from hf_dsinfer.injection.walker import get_report

TP, EP = 2, 2
VARIANTS = {  # case -> (model, ep_size, extra DSInferConfig fields)
    "hier": ("mixtral_8x2", EP, {"ep_node_size": 1}),
    "tp_only": ("qwen2_moe", 1, {}),
}


def _generate(model, ids, mask, new_tokens: int) -> list[list[int]]:
    gen = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    return model.generate(ids, attention_mask=mask, **gen).tolist()


def _share_tokens(report) -> list[int]:
    """Tokens each MoE layer sent through its all-to-all on this rank (its share)."""
    return [m.parallel.stats.tokens for m in report.moe.values()]


def run_case(name: str, rank: int) -> dict:
    group = rank // TP  # which TP group: its prompts and its generation length
    model, ep, extra = VARIANTS.get(name, (name, EP, {}))
    ref = make_model(model)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), tp_size=TP, ep_size=ep, strict=True,
                                      **extra)
    report = get_report(fused)
    lengths = (9, 5, 7) if group == 0 else (6, 8, 3)
    ids, mask = prompts(batch=3, lengths=lengths, seed=20 + group)
    valid = mask.bool()
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits
        before = _share_tokens(report) if ep > 1 else []
        b = fused(ids, attention_mask=mask).logits
        after = _share_tokens(report) if ep > 1 else []
    new = 4 + 3 * group
    row = lengths.index(min(lengths))  # the most padded prompt, alone and unpadded
    one, one_mask = ids[row:row + 1, -min(lengths):], mask[row:row + 1, -min(lengths):]
    result = {
        "logit_max_abs": (a[valid] - b[valid]).abs().max().item(),
        "batch_ref": _generate(ref, ids, mask, new),
        "batch": _generate(fused, ids, mask, new),
        "single_ref": _generate(ref, one, one_mask, new),
        "single": _generate(fused, one, one_mask, new),
        "padded_row": row,
        "new_tokens": new,
        "counts": hf_dsinfer.fused_call_counts(fused),
        "moe_paths": list(report.moe),
        "forward_tokens": int(ids.numel()),
        "explain": hf_dsinfer.explain(fused),
        "tp_ranks": list(report.tp.ranks),
        "qk_norm_sharded": [f.sharded_qk_norm is not None for f in report.blocks.values()],
    }
    if ep > 1:
        stats = [m.parallel.stats for m in report.moe.values()]
        result.update({
            "share_tokens": [n1 - n0 for n0, n1 in zip(before, after)],
            "ep_ranks": list(report.ep.ranks),
            "a2a_calls": [s.calls for s in stats],
            "a2a_row_bytes": sum(s.row_bytes for s in stats),
            "gathers": [s.gathers for s in stats],
            "local_experts": [int(m.experts.gate_up_proj.shape[0]) for m in report.moe.values()],
        })
    return result


def run_errors(rank: int) -> dict:
    """World 4: tp=2 x ep=4 and tp=4 x ep=2 need 8 ranks; both refused, model untouched."""
    messages = {}
    for tp, ep in ((2, 4), (4, 2)):
        model = make_model("mixtral_8x2")
        try:
            hf_dsinfer.init_inference(model, tp_size=tp, ep_size=ep)
            messages[f"tp{tp}_ep{ep}"] = None
        except ExpertParallelError as err:
            messages[f"tp{tp}_ep{ep}"] = str(err)
        messages[f"tp{tp}_ep{ep}_untouched"] = get_report(model) is None and \
            "forward" not in model.model.layers[0].__dict__
    return messages


def run_from_pretrained(rank: int) -> dict:
    """`from_pretrained(dir, dsinfer={"tp_size": 2, "ep_size": 2})` on a saved Mixtral: its
    per-expert tensors need transformers' converter, so every rank loads whole (with a warning)
    and slices in place; the result must equal the single-process model."""
    ref = make_model("mixtral_8x2")
    folder = os.path.join(sys.argv[1], "mixtral_checkpoint")
    if rank == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(
            folder, dsinfer={"tp_size": TP, "ep_size": EP, "strict": True})
    ids, mask = prompts(batch=3, lengths=(9, 5, 7), seed=20)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits[mask.bool()]
        b = model(ids, attention_mask=mask).logits[mask.bool()]
    return {"logit_max_abs": (a - b).abs().max().item(),
            "warned_whole_load": any("loads the whole model" in str(w.message) for w in caught),
            "counts": hf_dsinfer.fused_call_counts(model),
            "local_experts": [int(m.experts.gate_up_proj.shape[0])
                              for m in get_report(model).moe.values()]}


def run(case: str, rank: int, world: int) -> dict:
    assert world == TP * EP, f"launch {TP * EP} processes, got {world}"
    if case == "from_pretrained":
        return run_from_pretrained(rank)
    return run_errors(rank) if case == "errors" else run_case(case, rank)


if __name__ == "__main__":
    worker_main(run)
