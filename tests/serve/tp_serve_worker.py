"""torchrun worker: `hf-dsinfer serve`'s engine over a tensor-parallel model (tp_size=2).

Rank 0 serves the app (uvicorn in a thread, as tests/serve/conftest.py does) and asks it for
completions; rank 1 follows rank 0's schedule (`Engine.follow`, what the command line runs on
ranks other than 0) until rank 0's engine stops. Rank 0 writes what it got to argv[1] as JSON:
the answers, the single-process model's greedy tokens, the fused calls, and generate_batch on
every rank of a model whose KV heads tp_size does not divide."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
)

import hf_dsinfer
from hf_dsinfer.serve import Engine, ServeLimits
from tests.launch import exit_skipping_teardown
from tests.serve.conftest import CHAT_TEMPLATE, serve
from tests.tiny_models import make_model, tiny_tokenizer

PROMPTS = ([5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31])
NEW_TOKENS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 4 query heads over 2 KV heads: one KV head per rank at tp_size=2
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                         max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _engine(model: torch.nn.Module) -> Engine:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=16)
    return Engine(model, tokenizer, "tiny-llama", cb_config=cb,
                  limits=ServeLimits(max_requests=8))


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = _model()
    engine = _engine(hf_dsinfer.init_inference(copy.deepcopy(ref), tp_size=2))
    engine.start()
    result: dict = {"drives": engine.drives}
    if not engine.drives:
        result["follow_error"] = repr(engine.follow())
    else:
        with serve(engine) as served:
            answers = []
            for ids in PROMPTS:
                r = served.client.post("/v1/completions", json={
                    "model": "tiny-llama", "prompt": ids, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "return_token_ids": True})
                answers.append(r.json())
            result["answers"] = answers
            result["metrics"] = served.wait_idle()
        fused = hf_dsinfer.fused_call_counts(engine.model)
        result["fused_calls"] = fused
        result["expected"] = [
            ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    # generate_batch on every rank, on a model whose 3 KV heads tp_size=2 cannot split (every
    # rank keeps all of them, so the paged cache holds all of them too)
    odd_ref = make_model("llama")
    odd = hf_dsinfer.init_inference(copy.deepcopy(odd_ref), tp_size=2)
    gen = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    out = odd.generate_batch([list(p) for p in PROMPTS], generation_config=GenerationConfig(
        eos_token_id=-1, **gen), continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=32, page_size=8, max_batch_tokens=16))
    result["batch"] = [r.generated_tokens for r in out.values()]
    result["batch_expected"] = [odd_ref.generate(torch.tensor([p]), **gen)[0, len(p):].tolist()
                                for p in PROMPTS]
    result["restored"] = "_device_mesh" not in odd.__dict__
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result["batch"])
    result["batch_same_on_every_rank"] = all(g == result["batch"] for g in gathered)
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    exit_skipping_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
