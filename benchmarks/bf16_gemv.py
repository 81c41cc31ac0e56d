"""bf16 batch-1 decode of the torch-path families (gpt-oss, DeepSeek-V3): HF eager, hf_dsinfer with
the dispatch before the native bf16 GEMVs (torch.mv for one bf16 row, `x @ W` for gpt-oss's
transposed experts) and after (csrc/cpu_experts.c), interleaved in one process.

    python benchmarks/bf16_gemv.py --models gpt-oss-mini deepseek-v3-mini --threads 1 --rounds 5

Before timing, the first decode step's logits of both hf_dsinfer dispatches are checked against
the fp32 model's: no further from them than HF's own bf16 logits (x1.5). Prints a Markdown table: tok/s medians over the rounds, ratios to HF.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

import hf_dsinfer
from hf_dsinfer.benchmark import base_model
from hf_dsinfer.kernels import _native, crossovers, matmul_kn

PROMPT, NEW = 64, 16
# The decode logits' relative L2 error against the fp32 model may exceed HF bf16's own by this
# factor (bf16 rounding in another order along 8 random layers).
SLACK = 1.5


def _dispatch(old: bool, tier: str, rows: crossovers.Crossovers) -> None:
    """The old dispatch (no native bf16 GEMVs) or the current one."""
    crossovers.TABLE[tier] = dataclasses.replace(rows, bf16_gemv_max_rows=None) if old else rows
    matmul_kn.KN_MAX_ROWS = 0 if old else 4


def _decode_time(model, ids) -> tuple[float, list[int]]:
    gen = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **gen)
        one = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **gen)
        many = time.perf_counter() - start
    return (many - one) / (NEW - 1), out[0, ids.shape[1]:].tolist()


def _decode_logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        cache = model(ids).past_key_values
        return model(ids[:, -1:], past_key_values=cache).logits.float()


def _check(fused, want_fp32: torch.Tensor, hf_err: float, ids) -> None:
    """hf_dsinfer's bf16 decode logits are no further from the fp32 model's than HF's bf16."""
    got = _decode_logits(fused, ids)
    err = ((got - want_fp32).norm() / want_fp32.norm()).item()
    assert err <= SLACK * hf_err + 1e-3, (
        f"decode logits {err:.3f} from fp32 (relative L2), HF bf16's {hf_err:.3f}")


def run(name: str, rounds: int) -> str:
    tier = _native.tier()
    rows = crossovers.TABLE[tier]
    base = base_model(name, torch.bfloat16)
    fused = hf_dsinfer.init_inference(copy.deepcopy(base), parity_check=False)
    ids = torch.randint(3, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"hf": [], "before": [], "after": []}
    tokens = {}
    want = _decode_logits(copy.deepcopy(base).float(), ids[:, :-1])
    hf_err = ((_decode_logits(base, ids[:, :-1]) - want).norm() / want.norm()).item()
    try:
        for old in (True, False):
            _dispatch(old, tier, rows)
            _check(fused, want, hf_err, ids[:, :-1])
        for _ in range(rounds):
            for label, model in (("hf", base), ("before", fused), ("after", fused)):
                _dispatch(label == "before", tier, rows)
                step, tokens[label] = _decode_time(model, ids)
                times[label].append(step)
    finally:
        _dispatch(False, tier, rows)
    med = {k: statistics.median(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(tokens["hf"], tokens["after"]))
    return (f"| {name} | {torch.get_num_threads()} | {1 / med['hf']:.2f} | "
            f"{1 / med['before']:.2f} ({med['hf'] / med['before']:.2f}x) | "
            f"{1 / med['after']:.2f} ({med['hf'] / med['after']:.2f}x) | {same}/{NEW} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-oss-mini", "deepseek-v3-mini"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"native tier: {_native.tier()}")
    print("| model | threads | HF eager tok/s | before | after | greedy tokens = HF |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        print(run(name, args.rounds), flush=True)


if __name__ == "__main__":
    main()
