"""Decode on a CUDA GPU: HF eager and HF sdpa against hf_dsinfer's Triton path (bf16, int8,
int4), random-weight models shaped as in `hf-dsinfer bench`, one process, configurations
interleaved, medians. Before timing, each configuration's greedy tokens are compared with HF
eager's (bf16: the first tokens agree unless HF's own logits nearly tie).

    TRITON_INTERPRET=0 python benchmarks/gpu_decode.py --models llama-1.1b --batch 1 16

Prints a Markdown table: prefill ms, decode tok/s (all sequences), speed-up over HF eager, and
how many of the first 16 greedy tokens match HF eager's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from hf_dsinfer.api import init_inference
from hf_dsinfer.benchmark import MODELS

CONFIGS = {"hf": None, "hf-sdpa": None, "bf16": {}, "int8": {"quant": {"bits": 8}},
           "int4": {"quant": {"bits": 4}}}


def _timed(fn, *args, **kwargs) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-1.1b"],
                        choices=[m for m in MODELS if MODELS[m] is not None])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="hf_dsinfer's default on CUDA: static cache + compiled decode step "
                             "(minutes of compiling per configuration); without it the fused "
                             "models run eager, their Triton kernels launched one by one")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py: no CUDA device here. Fix: run it on a GPU machine "
                         "(benchmarks/decode.py measures the CPU).")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, fused decode "
          f"{'compiled' if args.compile else 'eager'}")
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        config = MODELS[name]()
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                attn_implementation="eager").cuda().eval()
        models = {}
        for cfg in args.configs:
            if cfg == "hf":
                models[cfg] = base
            elif cfg == "hf-sdpa":
                models[cfg] = copy.deepcopy(base)
                models[cfg].set_attn_implementation("sdpa")
            else:
                models[cfg] = init_inference(copy.deepcopy(base), **CONFIGS[cfg],
                                             compile=args.compile)
        for batch in args.batch:
            gen = torch.Generator(device="cuda").manual_seed(batch)
            ids = torch.randint(3, config.vocab_size, (batch, args.prompt_len), device="cuda",
                                generator=gen)
            kw = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
            first = {}
            with torch.inference_mode():
                for cfg, model in models.items():  # warm-up (Triton compiles) and tokens
                    first[cfg] = model.generate(ids, max_new_tokens=16, min_new_tokens=16,
                                                **kw)[:, -16:]
                pre = {c: [] for c in models}
                dec = {c: [] for c in models}
                for _ in range(args.repeats):
                    for cfg, model in models.items():
                        t_pre = _timed(model.generate, ids, max_new_tokens=1,
                                       min_new_tokens=1, **kw)
                        t_all = _timed(model.generate, ids, max_new_tokens=args.new_tokens,
                                       min_new_tokens=args.new_tokens, **kw)
                        pre[cfg].append(t_pre)
                        dec[cfg].append((t_all - t_pre) / (args.new_tokens - 1))
            hf_tps = batch / statistics.median(dec["hf"]) if "hf" in dec else None
            for cfg in models:
                tps = batch / statistics.median(dec[cfg])
                same = (first[cfg] == first.get("hf", first[cfg])).all(0)
                match = int(same.cumprod(0).sum().item())
                rows.append((name, batch, cfg, 1e3 * statistics.median(pre[cfg]), tps,
                             tps / hf_tps if hf_tps else float("nan"), match))
        del models, base
        torch.cuda.empty_cache()
    print("\n| model | batch | config | prefill ms | decode tok/s | vs HF eager | "
          "first tokens = HF |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, batch, cfg, pre_ms, tps, ratio, match in rows:
        print(f"| {name} | {batch} | {cfg} | {pre_ms:.1f} | {tps:.1f} | {ratio:.2f}x | "
              f"{match}/16 |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
