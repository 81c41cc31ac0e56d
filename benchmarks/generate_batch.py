"""Continuous-batching throughput: HF's `generate_batch` (sdpa) against the same call on fused
blocks (bf16; int4 weights; int4 weights with 8-bit activations, "-a8"; groups of 32, the
default for this shape, or of 128, "-g128"), on a random-weight Llama-1.1B-shaped model.

    python benchmarks/generate_batch.py                       # 32 requests, 32 new tokens each
    python benchmarks/generate_batch.py --requests 8 --new-tokens 8 --repeats 1 --model tiny

One process; configurations interleaved and repeated, medians reported. Every request gets
mixed-length random prompts (seeded) and greedy decoding to exactly --new-tokens tokens (no
EOS), so every configuration does the same work: the manager packs prefill chunks (under
--budget tokens per forward) and decode steps of all requests into one row over its paged cache.
Before timing, each configuration's tokens are compared with HF's (the share that agree: bf16
and int4 round differently, so greedy paths may part after a near-tie).

Before every call the calling thread's OpenMP workers are released
(hardware.release_openmp_threads), as an injected model's manager does when it starts: the
manager computes on its own thread, and beside the caller's idle pool every parallel region of
HF's would pay a wake-up (HF's SmolLM2 `generate_batch` ran at 55-63 tok/s with the caller's
pool kept and 102-117 without it, on the 2-core Xeon). HF is measured without that handicap,
whatever ran before it.

Printed per configuration: output tok/s (generated tokens / wall seconds of generate_batch),
all tok/s (prompt + generated), the ratio to HF, model forwards per run, and the weight bytes
those forwards read as GB/s and as a fraction of the memory-read bandwidth measured in the same
run (each forward reads every block weight once; the int4 model's second weight copy for torch's
kernel is not counted, see hf_dsinfer.benchmark._read_bytes).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

import hf_dsinfer
from hf_dsinfer.benchmark import MODELS, _read_bytes
from hf_dsinfer.hardware import read_bandwidth, release_openmp_threads

CONFIGS = {"hf": None, "bf16": {}, "int4": {"quant": {"bits": 4}},
           "int4-a8": {"quant": {"bits": 4, "act_bits": 8}},
           "int4-g128": {"quant": {"bits": 4, "group_size": 128}},
           "int4-a8-g128": {"quant": {"bits": 4, "group_size": 128, "act_bits": 8}}}


def build(name: str, configs: list[str]) -> dict:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.bfloat16,
                                            attn_implementation="sdpa").eval()
    return {c: base if CONFIGS[c] is None else hf_dsinfer.init_inference(
        copy.deepcopy(base), parity_check=False, **CONFIGS[c]) for c in configs}


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]


class ForwardCounter:
    """Counts the model's forwards (a forward pre-hook, removed by `close`)."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def run_once(model, inputs: list[list[int]], args: argparse.Namespace
             ) -> tuple[list[list[int]], float, int]:
    """(tokens per request, wall seconds, model forwards) of one generate_batch call."""
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=args.budget, page_size=args.page,
                                  num_blocks=args.blocks)
    counter = ForwardCounter(model)
    try:
        with torch.inference_mode():
            release_openmp_threads()  # for HF's manager too (see the module's docstring)
            start = time.perf_counter()
            out = model.generate_batch(inputs, generation_config=gen,
                                       continuous_batching_config=cb, warmup=False)
            seconds = time.perf_counter() - start
    finally:
        counter.close()
    tokens = [r.generated_tokens for r in out.values()]
    if len(tokens) != len(inputs) or any(len(t) != args.new_tokens for t in tokens):
        raise RuntimeError("generate_batch returned incomplete requests: "
                           f"{[len(t) for t in tokens]} (expected {args.new_tokens} each)")
    return tokens, seconds, counter.count


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> float:
    same = sum(a == b for t, r in zip(tokens, ref) for a, b in zip(t, r))
    return same / sum(len(r) for r in ref)


def table(args, configs, times, forwards, agree, read_bytes, prompt_tokens, bandwidth) -> str:
    out_tokens = args.requests * args.new_tokens
    lines = [(f"memory-read bandwidth measured in this run: {bandwidth:.1f} GB/s; "
             f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
             f"({prompt_tokens} in all), {args.new_tokens} new tokens each, token budget "
             f"{args.budget}, {torch.get_num_threads()} threads, median of {args.repeats}"), "",
             ("| config | output tok/s | all tok/s | vs HF (sdpa) | forwards | GB/s | "
             "% of read bw | model MB | tokens = HF |"),
             "|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(times["hf"]) if "hf" in times else None
    for c in configs:
        seconds = statistics.median(times[c])
        gbs = read_bytes[c] * forwards[c] / seconds / 1e9
        ratio = f"{base / seconds:.2f}x" if base else "-"
        lines.append(f"| {c} | {out_tokens / seconds:.1f} | "
                     f"{(out_tokens + prompt_tokens) / seconds:.1f} | {ratio} | {forwards[c]} | "
                     f"{gbs:.1f} | {gbs / bandwidth:.0%} | {read_bytes[c] / 2**20:.0f} | "
                     f"{agree[c]:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1.1b", choices=[m for m in MODELS if MODELS[m]])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256, help="max_batch_tokens per forward")
    parser.add_argument("--page", type=int, default=32, help="paged-cache page size")
    parser.add_argument("--blocks", type=int, default=512, help="paged-cache blocks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    variants = build(args.model, args.configs)
    inputs = prompts(args, next(iter(variants.values())).config.vocab_size)
    ref, agree, times, forwards = None, {}, {c: [] for c in args.configs}, {}
    for c in args.configs:  # warm-up run per config; its tokens are compared with HF's
        tokens, _, forwards[c] = run_once(variants[c], inputs, args)
        ref = tokens if ref is None else ref
        agree[c] = agreement(tokens, ref)
    for _ in range(args.repeats):
        for c in args.configs:  # interleaved: every config once per repeat
            times[c].append(run_once(variants[c], inputs, args)[1])
    read_bytes = {c: _read_bytes(variants[c]) for c in args.configs}
    print(table(args, args.configs, times, forwards, agree, read_bytes,
                sum(len(p) for p in inputs), read_bandwidth()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
