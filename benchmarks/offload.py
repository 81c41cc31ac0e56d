"""Offloaded generation under a memory limit: accelerate's disk offload vs hf_dsinfer's planned
FlexGen policy (with and without 4-bit compression), FlexGen's setting (prompt 512, 32 tokens).

    python benchmarks/offload.py                       # OPT-2.7B shape, 2.5 GiB limit
    python benchmarks/offload.py --layers 8 --limit 1.2GiB --prompt-len 128 --gen-len 8

Every run is a fresh process inside a cgroup-v1 memory limit (memory.limit_in_bytes covers the
page cache, so weights that do not fit are really read from disk each time). The model is an
OPT-2.7B-shaped random model saved as fp16 safetensors under /tmp (about 5.3 GB; `--layers`
makes a shorter one). Compute is bfloat16 on the CPU (AMX: ~1.3 TFLOP/s here, fp16 matmul on
CPU is far slower, fp32 ~0.2 TFLOP/s); both systems load the fp16 checkpoint as bf16.

For each system the table gives prefill, decode and total seconds and generated tokens/s
(batch x new tokens / total); accelerate is run at every batch of --accelerate-batches and its
best is the baseline; hf_dsinfer runs the policy `hf_dsinfer.offload.search` chooses for each
block size cap, and the table sets achieved beside the cost model's prediction. A PNG plots
throughput against effective batch size (FlexGen Fig. 1 style).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup/memory/hf_dsinfer_offload_bench")
HERE = Path(__file__).resolve()


# -- the model -------------------------------------------------------------------------------------
def opt_config(layers: int):
    from transformers import OPTConfig

    return OPTConfig(hidden_size=2560, num_attention_heads=32, num_hidden_layers=layers,
                     ffn_dim=10240, vocab_size=50272, max_position_embeddings=2048,
                     word_embed_proj_dim=2560, do_layer_norm_before=True, dtype="float16")


def make_model(folder: Path, layers: int) -> None:
    """Random OPT-shaped checkpoint, fp16 safetensors, written one shard at a time."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if (folder / "model.safetensors.index.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    config = opt_config(layers)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, names = {}, {}, list(shapes)
    for i, name in enumerate(names):
        shard[name] = _random(name, shapes[name], gen)
        if sum(t.numel() * 2 for t in shard.values()) > 1 << 30 or i == len(names) - 1:
            file = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard = {}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)


def _random(name: str, shape, gen) -> torch.Tensor:
    if name.endswith(("layer_norm.weight", "final_layer_norm.weight")):
        return torch.ones(shape, dtype=torch.float16)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.float16)
    return (torch.randn(shape, generator=gen) * 0.02).half()


# -- the cgroup ------------------------------------------------------------------------------------
def setup_cgroup(limit: int) -> None:
    CGROUP.mkdir(exist_ok=True)
    memory, swap = CGROUP / "memory.limit_in_bytes", CGROUP / "memory.memsw.limit_in_bytes"
    # memory + swap may never be below memory: raising the limit above an earlier run's
    # memsw limit writes memsw first, lowering it writes memory first
    order = [swap, memory] if swap.exists() and int(swap.read_text()) < limit else [memory, swap]
    for path in order:
        if path is swap:
            if swap.exists():
                try:
                    swap.write_text(str(limit))
                except OSError:
                    pass
        else:
            memory.write_text(str(limit))


def wait_for_quiet(max_load: float, patience_s: int) -> float:
    """Sleep (30 s at a time, up to `patience_s`) until the 1-minute load average is below
    `max_load` (the machine is shared); the load average the run starts under."""
    waited = 0
    while os.getloadavg()[0] >= max_load and waited < patience_s:
        time.sleep(30)
        waited += 30
    return os.getloadavg()[0]


def run_limited(spec: dict, timeout: int) -> dict:
    """Run one measurement in a fresh process inside the cgroup; its JSON line, or an error."""
    cmd = (f"echo $$ > {CGROUP}/cgroup.procs && exec {sys.executable} {HERE} --worker "
           f"'{json.dumps(spec)}'")
    # a fixed glibc mmap threshold: large freed tensors go back to the OS at once, in both
    # systems (the dynamic one keeps up to 32 MB chunks in the heap, ~1 GB of RSS after loading)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TRITON_INTERPRET": "0",
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    try:
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env,
                             timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        killed = out.returncode in (-9, 137)
        return {"error": "killed (out of memory in the cgroup)" if killed
                else out.stderr.strip().splitlines()[-1][:300] if out.stderr else "failed"}
    return json.loads(lines[-1])


# -- workers (inside the cgroup) -------------------------------------------------------------------
class StepClock:
    """A logits processor: generate() calls it once per step, right after the forward."""

    def __init__(self, stats: dict | None = None):
        self.stamps: list[float] = []
        self.stats = stats  # the offload engine's counters, snapshot after the prefill
        self.after_prefill: dict = {}

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1 and self.stats is not None:
            self.after_prefill = dict(self.stats)
        return scores


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    line = next(ln for ln in status.splitlines() if ln.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def _timed_generate(model, batch: int, prompt: int, gen: int) -> dict:
    from transformers import LogitsProcessorList

    ids = torch.randint(4, 50000, (batch, prompt), generator=torch.Generator().manual_seed(1))
    from hf_dsinfer.offload import get_engine

    engine = get_engine(model)
    if engine is not None:
        engine.reset_stats()
    clock = StepClock(engine.stats if engine is not None else None)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen,
                             min_new_tokens=gen, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]))
    end = time.perf_counter()
    assert out.shape == (batch, prompt + gen), out.shape
    prefill = clock.stamps[0] - start
    result = {"prefill_s": prefill, "decode_s": end - clock.stamps[0], "total_s": end - start,
              "tok_s": batch * gen / (end - start),
              "decode_tok_s": batch * (gen - 1) / max(end - clock.stamps[0], 1e-9)}
    if engine is not None:  # the engine's own clocks, per phase (seconds, all layers)
        before = clock.after_prefill
        result["phases"] = {"prefill": before,
                            "decode": {k: v - before.get(k, 0) for k, v in engine.stats.items()}}
    return result


def worker(spec: dict) -> dict:
    import hf_dsinfer  # noqa: F401

    torch.manual_seed(0)
    if spec["kind"] == "hardware":
        from hf_dsinfer.offload.cost import measure_hardware
        from hf_dsinfer.offload.search import measure_prefill_layer

        hw = json.loads(measure_hardware(spec["offload_dir"], torch.bfloat16, "cpu",
                                         sample=spec["model"]).to_json())
        layer = measure_prefill_layer(spec["model"], torch.bfloat16, "cpu", spec["prompt_len"])
        return {**hw, "prefill_layer_s": layer}
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    if spec["kind"] == "accelerate":
        model = AutoModelForCausalLM.from_pretrained(
            spec["model"], device_map="auto", max_memory={"cpu": spec["max_memory"]},
            offload_folder=spec["offload_dir"], dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], dsinfer={
            "dtype": "bfloat16", "parity_check": False, "offload": spec["policy"]})
    load_s = time.perf_counter() - start
    result = _timed_generate(model, spec["batch"], spec["prompt_len"], spec["gen_len"])
    return {**result, "load_s": load_s, "peak_rss": _peak_rss()}


# -- the driver ------------------------------------------------------------------------------------
def kv_bytes_per_seq(layers: int, tokens: int) -> int:
    return layers * tokens * 2 * 2560 * 2  # K and V, bf16


def accelerate_runs(args, model: str) -> list[dict]:
    rows = []
    for batch in args.accelerate_batches:
        room = args.limit - batch * kv_bytes_per_seq(args.layers, args.prompt_len + args.gen_len)
        max_memory = int(room - args.accelerate_reserve)
        if max_memory < 128 << 20:
            rows.append({"system": "accelerate", "batch": batch, "error": "KV cache alone "
                         "exceeds the limit"})
            continue
        spec = {"kind": "accelerate", "model": model, "batch": batch, "max_memory": max_memory,
                "offload_dir": str(args.work / "accelerate_offload"),
                "prompt_len": args.prompt_len, "gen_len": args.gen_len}
        load = wait_for_quiet(args.max_load, args.patience)
        rows.append({"system": "accelerate", "batch": batch, "max_memory": max_memory,
                     "load": load, **run_limited(spec, args.timeout)})
        _log(rows[-1])
    return rows


def ours_runs(args, model: str, hardware: dict, prefill_layer_s: float) -> list[dict]:
    from hf_dsinfer.offload.cost import Hardware, Workload
    from hf_dsinfer.offload.search import model_shape, search

    hw = Hardware(**hardware)
    shape = model_shape(model, torch.bfloat16)
    work = Workload(args.prompt_len, args.gen_len, prefill_layer_s)
    rows = []
    budget = args.limit - args.runtime_reserve
    for compress in args.compress:
        for cap in args.max_blocks:
            found = search(shape, hw, work, budget, str(args.work / "ours"),
                           compress=compress, max_block=cap)
            if not found:
                rows.append({"system": f"hf_dsinfer ({compress})", "batch": cap,
                             "error": "no feasible policy"})
                continue
            best = found[0]
            spec = {"kind": "ours", "model": model, "policy": best.policy.to_dict(),
                    "batch": best.policy.block_size, "prompt_len": args.prompt_len,
                    "gen_len": args.gen_len}
            row = {"system": "hf_dsinfer 4-bit" if compress == "on" else "hf_dsinfer",
                   "batch": best.policy.block_size, "policy": best.policy.describe(),
                   "pred_tok_s": best.prediction.throughput,
                   "pred_prefill_s": best.prediction.prefill_s,
                   "pred_decode_s": best.prediction.decode_s,
                   "pred_terms": predicted_terms(shape, hw, best.policy, work)}
            load = wait_for_quiet(args.max_load, args.patience)
            rows.append({**row, "load": load, **run_limited(spec, args.timeout)})
            _log(rows[-1])
    return rows


def predicted_terms(shape, hw, policy, work) -> dict:
    """The cost model's per-phase terms summed over the layers (seconds): disk/host reads and
    compute of the prefill and of all decode steps, to set beside the engine's clocks."""
    from hf_dsinfer.offload.cost import layer_terms

    out = {}
    for phase, prefill, steps in (("prefill", True, 1), ("decode", False, work.gen_len - 1)):
        terms = layer_terms(shape, hw, policy, work, policy.block_size, prefill)
        scale = shape.num_layers * steps
        out[phase] = {"read": terms.read * scale, "compute": terms.compute * scale}
    return out


def phase_table(rows: list[dict]) -> str:
    """Predicted vs measured per phase, all layers: reads (weights by the loader thread, KV by
    the cache's reader threads, their times summed, so it can exceed the wall time) and compute
    (inside the layer forwards)."""
    lines = [("| system | batch | phase | wall s | pred. read s | weight read s | "
              "KV read s (sum over reader threads) | "
              "waited for weights s | pred. compute s | compute s |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "phases" not in r or "pred_terms" not in r:
            continue
        for phase in ("prefill", "decode"):
            got, pred = r["phases"][phase], r["pred_terms"][phase]
            lines.append(
                f"| {r['system']} | {r['batch']} | {phase} | {r[phase + '_s']:.1f} | "
                f"{pred['read']:.1f} | {got.get('load_s', 0):.1f} | {got.get('kv_read_s', 0):.1f}"
                f" | {got.get('wait_s', 0):.1f} | {pred['compute']:.1f} | "
                f"{got.get('compute_s', 0):.1f} |")
    return "\n".join(lines)


def _log(row: dict) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)


def table(rows: list[dict]) -> str:
    lines = [("| system | batch | load avg | prefill s (pred.) | decode s (pred.) | total s | "
              "tok/s | decode tok/s | predicted tok/s | achieved / predicted | peak RSS GiB | "
              "policy / note |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        load = f"{r['load']:.1f}" if "load" in r else "-"
        if "error" in r:
            lines.append(f"| {r['system']} | {r['batch']} | {load} | - | - | - | - | - | - | - | "
                         f"- | {r['error']} |")
            continue
        pred = r.get("pred_tok_s")
        note = (r.get("policy") or "").replace(" | ", "; ") or \
            f"max_memory {r.get('max_memory', 0) / 2**30:.2f} GiB"
        predicted = f"{pred:.2f}" if pred else "-"
        ratio = f"{r['tok_s'] / pred:.0%}" if pred else "-"
        pre = f" ({r['pred_prefill_s']:.1f})" if pred else ""
        dec = f" ({r['pred_decode_s']:.1f})" if pred else ""
        lines.append(
            f"| {r['system']} | {r['batch']} | {load} | {r['prefill_s']:.1f}{pre} | "
            f"{r['decode_s']:.1f}{dec} | {r['total_s']:.1f} | {r['tok_s']:.2f} | "
            f"{r['decode_tok_s']:.2f} | {predicted} | {ratio} | {r['peak_rss'] / 2**30:.2f} | "
            f"{note} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    acc = max((r["tok_s"] for r in ok if r["system"] == "accelerate"), default=None)
    if not acc:
        return "accelerate produced no result: no ratio."
    out = [f"accelerate best: {acc:.3f} tok/s"]
    for system in ("hf_dsinfer", "hf_dsinfer 4-bit"):
        best = max((r for r in ok if r["system"] == system), key=lambda r: r["tok_s"],
                   default=None)
        if best:
            out.append(f"{system} best: {best['tok_s']:.3f} tok/s = {best['tok_s'] / acc:.2f}x "
                       f"accelerate, {best['tok_s'] / best['pred_tok_s']:.0%} of predicted")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, marker in (("accelerate", "o"), ("hf_dsinfer", "s"), ("hf_dsinfer 4-bit", "^")):
        pts = sorted((r["batch"], r["tok_s"]) for r in rows
                     if r["system"] == system and "error" not in r)
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("effective batch size (sequences per block)")
    ax.set_ylabel("generation throughput (token/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    from hf_dsinfer.offload.policy import parse_bytes

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (OPT-2.7B: 32)")
    p.add_argument("--limit", default="2.5GiB", help="cgroup memory limit (RAM + page cache)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--accelerate-batches", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--previous", type=Path, default=None,
                   help="JSON of an earlier run with the same settings: its rows are reused")
    p.add_argument("--max-load", type=float, default=1.5,
                   help="wait (30 s steps) until the 1-minute load average is below this")
    p.add_argument("--patience", type=int, default=600,
                   help="seconds to wait for --max-load before running anyway")
    p.add_argument("--max-blocks", type=int, nargs="+", default=[8, 16, 32],
                   help="block-size caps for hf_dsinfer's policy search, one run each")
    p.add_argument("--compress", nargs="+", choices=("off", "on"), default=["off", "on"])
    p.add_argument("--runtime-reserve", default="600MiB",
                   help="part of the limit left to Python/torch/transformers themselves")
    p.add_argument("--accelerate-reserve", default="600MiB",
                   help="part of the limit accelerate's max_memory leaves to the runtime and its "
                        "loader (raise it when accelerate is killed in the cgroup)")
    p.add_argument("--work", type=Path, default=Path("/tmp/hf_dsinfer_bench"))
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--png", type=Path, default=Path("/tmp/hf_dsinfer_bench/offload.png"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        args.limit = parse_bytes(args.limit, "limit")
        args.runtime_reserve = parse_bytes(args.runtime_reserve, "runtime_reserve")
        args.accelerate_reserve = parse_bytes(args.accelerate_reserve, "accelerate_reserve")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    model = args.work / f"opt-2.7b-shape-{args.layers}L-fp16"
    make_model(model, args.layers)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    setup_cgroup(args.limit)
    wait_for_quiet(args.max_load, args.patience)
    hardware = run_limited({"kind": "hardware", "offload_dir": str(args.work / "ours"),
                            "model": str(model), "prompt_len": args.prompt_len}, 600)
    if "error" in hardware:
        print(f"measuring the hardware failed: {hardware['error']}")
        return 1
    layer_s = hardware.pop("prefill_layer_s")
    from hf_dsinfer.offload.cost import Hardware
    from hf_dsinfer.offload.search import describe_hardware

    header = (f"model: OPT-2.7B shape, {args.layers} layers, {size / 1e9:.2f} GB fp16 "
              f"safetensors; limit {args.limit / 2**30:.2f} GiB (cgroup v1, page cache "
              f"included); prompt {args.prompt_len}, {args.gen_len} new tokens; bf16 compute on "
              f"{os.cpu_count()} CPU cores\n{describe_hardware(Hardware(**hardware))}, "
              f"prefill of one layer {layer_s * 1e3:.1f} ms per sequence (inside the limit)")
    print(header, flush=True)
    rows = json.loads(args.previous.read_text())["rows"] if args.previous else []
    rows += accelerate_runs(args, str(model)) + ours_runs(args, str(model), hardware, layer_s)
    print(table(rows))
    print()
    print(phase_table(rows))
    print(summary(rows))
    plot(rows, args.png, f"OPT-2.7B shape ({args.layers} layers), {args.limit / 2**30:.1f} GiB "
         f"limit, prompt {args.prompt_len}, gen {args.gen_len}, CPU")
    (args.png.with_suffix(".json")).write_text(json.dumps({"header": header, "rows": rows}))
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
