"""Run under `torchrun --nproc-per-node N ep_worker.py OUT_DIR CASE...`: expert-parallel fused
MoE models against the same model unsharded (ep=1, computed on this rank), one JSON per rank.

Each rank feeds its *own* prompts (the dense parts are data parallel) and asks for a different
number of new tokens, so ranks finish generating at different steps and the early ones must
keep joining the all-to-alls. Cases:
    flat         Mixtral 8 experts top-2, ep=N, one flat all-to-all
    hier         the same with a hierarchical all-to-all (ep_node_size=1 for N=2, 2 for N=4)
    top1         Mixtral 4 experts top-1
    shared       Qwen2-MoE: shared expert, a dense layer in between
    slicing      a 1-expert Mixtral: each rank holds 1/N of the expert's FFN (expert slicing)
    bf16         Mixtral 8 experts top-2 in bf16, against the fused ep=1 model (logits within
                 3%; greedy tokens reported, they may differ at bf16 routing near-ties)
    gpt_oss      gpt-oss 8 experts top-4: router bias, transposed biased experts, clamped SwiGLU
    deepseek_v3  DeepSeek-V3: MLA, a dense first layer, sigmoid group-limited routing, shared
                 expert
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from launch import exit_skipping_teardown
from tiny_models import MOE_CONFIGS, make_model, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report

CASES = {  # name -> (model, dtype, extra DSInferConfig fields)
    "flat": ("mixtral_8x2", torch.float32, {}),
    "hier": ("mixtral_8x2", torch.float32, {"ep_node_size": "half"}),
    "top1": ("mixtral_4x1", torch.float32, {}),
    "shared": ("qwen2_moe", torch.float32, {}),
    "slicing": ("mixtral_1x1", torch.float32, {}),
    "bf16": ("mixtral_8x2", torch.bfloat16, {}),
    "gpt_oss": ("gpt_oss", torch.float32, {}),
    "deepseek_v3": ("deepseek_v3", torch.float32, {}),
}


def _model(name: str, dtype: torch.dtype):
    if name != "mixtral_1x1":
        return make_model(name, dtype=dtype)
    config = MOE_CONFIGS["mixtral_4x1"]()
    config.num_local_experts = 1
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                            attn_implementation="eager").eval()


def run_case(case: str, rank: int, world: int) -> dict:
    name, dtype, extra = CASES[case]
    extra = {k: (max(1, world // 2) if v == "half" else v) for k, v in extra.items()}
    ref = _model(name, dtype)
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref), ep_size=world, strict=True, **extra)
    if dtype != torch.float32:  # bf16: ep=N against ep=1, both fused
        ref = hf_dsinfer.init_inference(ref, strict=True)
    ids, mask = prompts(batch=2, lengths=(9, 5) if rank % 2 else (4, 7), seed=10 + rank)
    gen = {"max_new_tokens": 3 + 3 * rank, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        a = ref(ids, attention_mask=mask).logits.float()
        b = fused(ids, attention_mask=mask).logits.float()
    expected = ref.generate(ids, attention_mask=mask, **gen)
    got = fused.generate(ids, attention_mask=mask, **gen)
    valid = mask.bool()
    report = get_report(fused)
    moe = next(iter(report.moe.values()))
    return {
        "logit_max_abs": (a[valid] - b[valid]).abs().max().item(),
        "logit_scale": a[valid].abs().max().item(),
        "tokens_equal": bool(torch.equal(expected, got)),
        "moe_calls": sum(m.calls for m in report.moe.values()),
        "a2a_calls": sum(m.parallel.stats.calls for m in report.moe.values()),
        "bytes_per_token": moe.parallel.stats.per_token(),
        "local_experts": int(moe.experts.gate_up_proj.shape[0]),
        "local_intermediate": int(moe.experts.down_proj.shape[2]),
        "explain_has_ep": "expert parallel:" in hf_dsinfer.explain(fused),
        "dtype": str(dtype),
    }


def worker_main(run: Callable[[str, int, int], dict]) -> None:
    """argv: OUT_DIR CASE...; writes {case: run(case, rank, world)} to OUT_DIR/rank<r>.json."""
    out_dir, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {case: run(case, rank, world) for case in cases}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_teardown()


if __name__ == "__main__":
    worker_main(run_case)
