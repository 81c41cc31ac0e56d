"""Launched by test_parallel_fetch.py: `torchrun --nproc-per-node N fetch_worker.py OUT DIR`.

Every rank offloads the same tiny Llama's layers to one shared disk folder with
`parallel_fetch=True` (rank 0 writes it, the others verify it), generates greedily from the same
left-padded batch, and compares with HF eager and with the same offload read whole by one rank
(world 1's path, in its own folder). Each rank writes OUT.<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "..")]  # tiny_models, and this checkout's package

import torch
import torch.distributed as dist
from launch import exit_skipping_teardown
from tiny_models import make_model, prompts

import hf_dsinfer
from hf_dsinfer.offload.attach import get_engine

POLICY = {"weights": (0, 0, 100), "cache": (0, 100, 0), "micro_batch_size": 3}


def _greedy(model, ids, mask) -> list[list[int]]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=0).tolist()


def check(root: str, rank: int) -> dict:
    ids, mask = prompts()
    hf = _greedy(make_model("llama"), ids, mask)
    whole = hf_dsinfer.init_inference(make_model("llama"), offload={
        **POLICY, "offload_dir": os.path.join(root, f"whole{rank}")})
    fetched = hf_dsinfer.init_inference(make_model("llama"), offload={
        **POLICY, "offload_dir": os.path.join(root, "shared"), "parallel_fetch": True})
    engine = get_engine(fetched)
    fetch = engine.store.fetch
    engine.reset_stats()
    read0, gathered0 = fetch.bytes_read, fetch.bytes_gathered
    tokens = _greedy(fetched, ids, mask)
    file_bytes = [f.size for f in engine.store.disk]
    return {
        "tokens": [hf, _greedy(whole, ids, mask), tokens],
        "loads": engine.stats["loads"],
        "read": fetch.bytes_read - read0,
        "gathered": fetch.bytes_gathered - gathered0,
        "file_bytes": file_bytes,
        "fused_calls": sum(hf_dsinfer.fused_call_counts(fetched).values()),
        "explain": hf_dsinfer.explain(fetched),
    }


def main() -> None:
    out_path, root = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = check(root, rank)
    except Exception:  # noqa: BLE001  (into the JSON: the pytest side shows the traceback)
        result = {"crash": traceback.format_exc()}
    result["world"] = dist.get_world_size()
    with open(f"{out_path}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
