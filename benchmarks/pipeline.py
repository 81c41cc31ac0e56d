"""Pipelined generate: measured bubble vs the simulator vs the ideal; dynamic queue vs a
lock-step baseline; transformers' own pp_size side by side.

    torchrun --nproc-per-node 2 benchmarks/pipeline.py [--layers 8] [--hidden 512] [--batch 8]
    torchrun --nproc-per-node 3 benchmarks/pipeline.py

A random Llama-shaped model (built from a config, saved once, loaded per stage with
`from_pretrained(dir, dsinfer={"pp_size": P})`) generates greedily from a left-padded batch.
Every rank builds the same HF model; before timing, every schedule's tokens are checked
against HF eager. HF eager runs in every process at once (one process per core, as the
pipeline's stages do) and the runs are interleaved round by round.
Per run, every rank reports the seconds it spent serving prompt and decode items (busy: the
forwards, HF's input preparation, sampling, posting messages) and waiting for messages; the
measured bubble is 1 - sum(busy) / (P * loop wall time). The simulator (hf_dsinfer.parallel.schedule_sim) gets
the measured per-stage busy time of one prompt and one decode micro-batch and the measured
point-to-point latency of one hidden state, and predicts the bubble and the wall time; the
ideal is fill and drain once with free links. Medians over --repeats runs. transformers'
`DistributedConfig(pp_size=P)` runs the same generate (lock-step, one micro-batch) where it
loads. Then the simulator alone extrapolates to 2-64 stages with the measured per-layer time.
Prints Markdown tables on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, LlamaConfig

import hf_dsinfer  # noqa: F401  (registers dsinfer=)
from hf_dsinfer.parallel.schedule_sim import Workload, ideal_bubble, simulate


def build_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=args.hidden // 128, vocab_size=4096,
                       max_position_embeddings=512, initializer_range=0.15, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)


def make_prompts(batch: int, length: int, padded: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4096, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(batch if padded else 0):  # left padding: lengths length .. length / 2
        pad = (row * length) // (2 * batch)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def p2p_latency(tensor: torch.Tensor, repeats: int = 20) -> float:
    """Half the median round trip of `tensor` between ranks 0 and 1 (others idle)."""
    rank, times = dist.get_rank(), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def timed_generate(model, ids, mask, new: int, **kwargs) -> tuple[float, list, torch.Tensor]:
    """Every rank runs `model.generate` (a plain HF model runs in each process alone)."""
    dist.barrier()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **kwargs)
    wall = time.perf_counter() - start
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, getattr(model.generate, "last_stats", {}))
    return wall, stats, out


def summarize(runs: list[tuple[float, list]]) -> dict:
    """The median run (by wall time) of one of our schedules, with its bubble."""
    wall, stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    loop = max(s["wall_s"] for s in stats)
    busy = [s["prompt_s"] + s["decode_s"] for s in stats]
    compute = [s["compute_s"] for s in stats]
    return {"wall": wall, "loop": loop, "bubble": 1 - sum(busy) / (len(busy) * loop),
            "compute_share": sum(compute) / sum(busy), "stats": stats}


def simulated(stats: list, args, link: float, lockstep: bool) -> tuple[float, float, Workload]:
    s0 = stats[0]
    work = Workload(
        stages=len(stats), prompt_micro_batches=s0["prompt_micro_batches"],
        micro_batches=s0["micro_batches"], steps=args.new - 1,
        prompt_time=[s["prompt_s"] / s["prompt_forwards"] for s in stats],
        decode_time=[s["decode_s"] / max(1, s["decode_forwards"]) for s in stats],
        link_time=link, token_time=link, lockstep=lockstep)
    result = simulate(work)
    return result.bubble_fraction, result.makespan, work


def load_hf_pipeline(folder: str, pp: int) -> tuple[object | None, str]:
    """transformers' own DistributedConfig(pp_size=P), or why it does not load."""
    from transformers.distributed import DistributedConfig

    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=DistributedConfig(pp_size=pp), dtype=torch.float32), ""
    except Exception as err:  # noqa: BLE001  (reported in the table: where it does not work)
        return None, f"does not load: {type(err).__name__}: {str(err)[:160]}"


SURVEY = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "opt", "gpt_neox", "mixtral_8x2"]


def hf_pp_survey(pp: int, root: str) -> list[str]:
    """transformers' DistributedConfig(pp_size) on tiny models of several families: does it
    load, and are its greedy tokens HF eager's with and without left padding? (Ours are, for
    every family: tests/parallel/test_pipeline_parallel.py.)"""
    from tiny_models import make_model, prompts
    from transformers.distributed import DistributedConfig

    rows = []
    for name in SURVEY:
        folder = os.path.join(root, f"survey_{name}")
        if dist.get_rank() == 0:
            make_model(name).save_pretrained(folder)
        dist.barrier()
        ref, (ids, mask) = make_model(name), prompts(batch=3)
        if ref.config.num_hidden_layers < pp:  # its split would leave a stage without layers
            rows.append(f"| {name} | not tried: {ref.config.num_hidden_layers} layers < "
                        f"{pp} stages | - | - |")
            continue
        gen = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=DistributedConfig(pp_size=pp))
            plain = ids[1:2, -5:]
            same = torch.equal(model.generate(plain, **gen), ref.generate(plain, **gen))
            padded = torch.equal(model.generate(ids, attention_mask=mask, **gen),
                                 ref.generate(ids, attention_mask=mask, **gen))
            rows.append(f"| {name} | loads | {'identical' if same else 'DIFFERENT'} | "
                        f"{'identical' if padded else 'DIFFERENT'} |")
        except Exception as err:  # noqa: BLE001  (the survey reports it)
            rows.append(f"| {name} | {type(err).__name__}: {str(err)[:70]} | - | - |")
        dist.barrier()
    return rows


def extrapolate(per_layer: float, head: float, link: float, args) -> list[str]:
    """Simulator only: a model of 64 such layers on 2-64 stages (per-layer time measured)."""
    rows = []
    for stages in (2, 4, 8, 16, 32, 64):
        layers = 64 // stages
        decode = [per_layer * layers] * stages
        decode[-1] += head
        work = Workload(stages, 2 * stages, stages, 63, [4 * d for d in decode], decode,
                        link, link)
        dyn = simulate(work)
        lock = simulate(Workload(**{**work.__dict__, "lockstep": True}))
        rows.append(f"| {stages} | {dyn.bubble_fraction:.3f} | {ideal_bubble(work):.3f} | "
                    f"{lock.bubble_fraction:.3f} | {lock.makespan / dyn.makespan:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    folder = os.path.join(tempfile.gettempdir(), f"hf_dsinfer_pp_bench_{args.layers}_{args.hidden}")
    config = build_config(args)
    ids, mask = make_prompts(args.batch, args.prompt)
    full_ids, full_mask = make_prompts(args.batch, args.prompt, padded=False)
    torch.manual_seed(0)  # every rank builds the same reference model
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if rank == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    gen = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False,
           "pad_token_id": 0}
    want = ref.generate(ids, attention_mask=mask, **gen)
    full_want = ref.generate(full_ids, attention_mask=full_mask, **gen)
    model = AutoModelForCausalLM.from_pretrained(folder, dsinfer={"pp_size": pp})
    hf_pp, hf_pp_why = load_hf_pipeline(folder, pp)
    timed_generate(model, ids, mask, 2)  # warm-up
    link = p2p_latency(torch.zeros(args.batch // 2, 1, args.hidden))
    walls: dict[str, list] = {"hf": [], "dynamic": [], "lockstep": [], "hf_pp": []}
    for _ in range(args.repeats):  # interleaved, so that a busy moment hits all alike
        walls["hf"].append(timed_generate(ref, ids, mask, args.new)[0])
        for schedule in ("dynamic", "lockstep"):
            wall, stats, out = timed_generate(model, ids, mask, args.new, pp_schedule=schedule)
            if not torch.equal(out, want):
                raise SystemExit(f"{schedule}: tokens differ from HF eager; not timing it")
            walls[schedule].append((wall, stats))
        if hf_pp is not None:
            wall, _, hf_pp_out = timed_generate(hf_pp, ids, mask, args.new)
            walls["hf_pp"].append(wall)
    runs = {s: summarize(walls[s]) for s in ("dynamic", "lockstep")}
    survey = hf_pp_survey(pp, tempfile.gettempdir())
    if hf_pp is not None:
        same = "identical to" if torch.equal(hf_pp_out, want) else "DIFFERENT from"
        full = timed_generate(hf_pp, full_ids, full_mask, args.new)[2]
        hf_pp_why = (f"tokens {same} HF eager on the left-padded batch, "
                     f"{'identical' if torch.equal(full, full_want) else 'DIFFERENT'} "
                     "without padding")
    if rank:
        return
    tokens = args.batch * args.new
    print(f"\n## Pipeline generate, pp={pp}: Llama-shaped, {args.layers} layers, hidden "
          f"{args.hidden}, fp32, batch {args.batch} (left-padded), prompt {args.prompt}, "
          f"{args.new} new tokens, greedy; 1 thread per rank; medians of {args.repeats}\n")
    print("| schedule | tok/s | vs HF eager (1 process) | bubble measured | simulated | "
          "ideal | simulated wall / measured loop |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    hf_rate = tokens / statistics.median(walls["hf"])
    print(f"| HF eager, 1 process per rank | {hf_rate:.1f} | 1.00x | - | - | - | - |")
    for name, run in runs.items():
        bubble, makespan, work = simulated(runs["dynamic"]["stats"], args, link,
                                           name == "lockstep")
        rate = tokens / run["wall"]
        print(f"| hf_dsinfer {name} | {rate:.1f} | {rate / hf_rate:.2f}x | {run['bubble']:.3f} "
              f"| {bubble:.3f} | {ideal_bubble(work):.3f} | {makespan / run['loop']:.2f} |")
    if hf_pp is not None:
        rate = tokens / statistics.median(walls["hf_pp"])
        print(f"| transformers pp_size={pp} | {rate:.1f} | {rate / hf_rate:.2f}x | - | - | - "
              "| - |")
    print(f"\ntransformers pp_size={pp}: {hf_pp_why}")
    print(f"\n## transformers' own DistributedConfig(pp_size={pp}) on the tiny test models "
          "(greedy, 4 tokens, vs HF eager)\n")
    print("| family | load | tokens, no padding | tokens, left-padded batch |")
    print("| --- | --- | --- | --- |")
    print("\n".join(survey))
    speed = runs["lockstep"]["wall"] / runs["dynamic"]["wall"]
    s0 = runs["dynamic"]["stats"][0]
    print(f"\nshare of the stages' busy time inside model forwards (the rest: HF's input "
          f"preparation, sampling, messages): {runs['dynamic']['compute_share']:.2f}")
    print(f"dynamic queue vs lock-step: {speed:.2f}x; micro-batches: "
          f"{s0['prompt_micro_batches']} prompt / {s0['micro_batches']} generation; measured "
          f"point-to-point latency of one hidden state: {link * 1e6:.0f} us")
    decode = [s["decode_s"] / s["decode_forwards"] for s in runs["dynamic"]["stats"]]
    per_layer = sum(decode) / args.layers
    print(f"\n## Simulator only: 64 such layers on P stages, {per_layer * 1e3:.2f} ms per layer "
          "and micro-batch step (measured), prompt 4x a step, 2P prompt / P generation "
          "micro-batches, 64 tokens, the measured link latency\n")
    print("| stages | bubble (dynamic) | ideal | bubble (lock-step) | lock-step wall / "
          "dynamic |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(extrapolate(per_layer, 0.0, link, args)))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
