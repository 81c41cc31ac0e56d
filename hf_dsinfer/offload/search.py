"""Policy search: FlexGen's linear program, solved with scipy's HiGHS, and `hf-dsinfer plan`.

For every candidate block (micro_batch_size x num_micro_batches) and compression choice, one LP
chooses the placement fractions x = (w_dev, w_cpu, w_disk, c_dev, c_cpu, c_disk) and the step
times T_pre, T_dec:

    minimise   L * (T_pre + (n - 1) * T_dec)
    subject to T_pre >= read_pre(x), write_pre(x), compute_pre(x)      (cost.py, overlap;
               T_dec >= read_dec(x), write_dec(x), compute_dec(x)       without: >= their sum)
               w_dev + w_cpu + w_disk = 1,  c_dev + c_cpu + c_disk = 1
               host RAM(x) <= memory, device memory(x) <= device_memory     (memory.py)
               disk(x) <= free space in offload_dir
               on a CPU compute device: w_dev = c_dev = 0 (one RAM, called "cpu")

The memory rows come from `memory.footprint`, the same formula the runtime budget check uses
(it is affine in x, so its coefficients are read off by evaluating it at the unit placements).
The best candidate by predicted throughput is rounded to whole percentages, re-checked against
the budget, and returned as an OffloadPolicy.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from hf_dsinfer.hardware import synchronize
from hf_dsinfer.offload.cost import Hardware, Prediction, Workload, layer_coefficients, predict
from hf_dsinfer.offload.memory import ModelShape, footprint
from hf_dsinfer.offload.policy import OffloadPolicy, format_bytes, parse_bytes

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
TERMS = ("read", "write", "compute")
NUM_MICRO = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Candidate:
    policy: OffloadPolicy
    prediction: Prediction
    host_bytes: float  # peak host RAM by memory.footprint


def _base_policy(micro: int, num: int, compress: bool, overlap: bool, offload_dir: str,
                 memory: int | None, device_memory: int | None, device: str) -> OffloadPolicy:
    return OffloadPolicy(weights=(0, 0, 100), cache=(0, 0, 100), micro_batch_size=micro,
                         num_micro_batches=num, compress_weights=compress, overlap=overlap,
                         compress_cache=compress, offload_dir=offload_dir, memory=memory,
                         device_memory=device_memory, device=device)


def _memory_rows(shape: ModelShape, policy: OffloadPolicy, cuda: bool, work: Workload):
    """(host row, host constant, device row, device constant) of the affine footprint."""
    def total(w, c):
        fp = footprint(shape, policy.replace(weights=w, cache=c), cuda, policy.block_size,
                       work.prompt_len, work.gen_len)
        return fp.host_total, fp.device_total

    base = total((0, 0, 100), (0, 0, 100))
    units = [((100, 0, 0), (0, 0, 100)), ((0, 100, 0), (0, 0, 100)), ((0, 0, 100), (0, 0, 100)),
             ((0, 0, 100), (100, 0, 0)), ((0, 0, 100), (0, 100, 0)), ((0, 0, 100), (0, 0, 100))]
    rows = np.array([[t - b for t, b in zip(total(w, c), base)] for w, c in units])  # [6, 2]
    return rows[:, 0], base[0], rows[:, 1], base[1]


def solve(shape: ModelShape, hw: Hardware, work: Workload, policy: OffloadPolicy,
          free_disk: float) -> tuple[np.ndarray, float] | None:
    """Optimal fractions (6,) and total seconds for one candidate, or None when infeasible."""
    from scipy.optimize import linprog

    cuda = hw.device.startswith("cuda")
    batch, n, layers = policy.block_size, work.gen_len, shape.num_layers
    c = np.zeros(8)
    c[6], c[7] = layers, layers * max(n - 1, 0)
    a_ub, b_ub = [], []
    for phase, col in ((True, 6), (False, 7)):
        coef = layer_coefficients(shape, hw, work, batch, policy.micro_batch_size, phase,
                                  policy.compress_weights, policy.compress_cache,
                                  policy.group_size)
        # overlap: the step takes the longest term; without: their sum
        groups = [[t] for t in TERMS] if policy.overlap else [list(TERMS)]
        for terms in groups:
            row = np.zeros(8)
            row[:6] = np.sum([coef[t] for t in terms], axis=0)
            row[col] = -1.0
            a_ub.append(row)
            b_ub.append(-sum(coef[t + "0"] for t in terms))
    host, host0, dev, dev0 = _memory_rows(shape, policy, cuda, work)
    for row6, const, budget in ((host, host0, policy.memory), (dev, dev0, policy.device_memory)):
        if budget is not None and (cuda or row6 is host):
            a_ub.append(np.concatenate([row6, [0, 0]]))
            b_ub.append(budget - const)
    disk = np.zeros(8)
    disk[2] = layers * shape.layer_bytes(policy.compress_weights, policy.group_size)
    disk[5] = batch * (work.prompt_len + n) * layers * shape.kv_token_bytes(
        policy.compress_cache, policy.group_size)
    a_ub.append(disk)
    b_ub.append(free_disk)
    a_eq = np.array([[1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0]], dtype=float)
    bounds = [(0, 0 if not cuda and i in (0, 3) else 1) for i in range(6)] + [(0, None)] * 2
    res = linprog(c, A_ub=np.array(a_ub), b_ub=np.array(b_ub), A_eq=a_eq, b_eq=[1, 1],
                  bounds=bounds, method="highs")
    return (res.x[:6], float(res.fun)) if res.status == 0 else None


def _percent(fractions: np.ndarray) -> tuple[int, int, int]:
    """Whole percentages summing to 100 (largest remainder), rounding toward disk on ties."""
    raw = np.clip(fractions, 0, 1) * 100
    floor = np.floor(raw + 1e-9).astype(int)
    for i in np.argsort(-(raw - floor), kind="stable")[: 100 - floor.sum()]:
        floor[i] += 1
    return tuple(int(v) for v in floor)


def _round_to_budget(shape: ModelShape, policy: OffloadPolicy, fractions: np.ndarray,
                     cuda: bool, work: Workload) -> OffloadPolicy | None:
    """Round to whole percentages; move 1% at a time toward disk until the budget holds."""
    w, c = list(_percent(fractions[:3])), list(_percent(fractions[3:]))
    for _ in range(201):
        candidate = policy.replace(weights=tuple(w), cache=tuple(c))
        fp = footprint(shape, candidate, cuda, candidate.block_size, work.prompt_len,
                       work.gen_len)
        if (policy.memory is None or fp.host_total <= policy.memory) and (
                not cuda or policy.device_memory is None
                or fp.device_total <= policy.device_memory):
            return candidate
        shares = c if c[0] + c[1] >= w[0] + w[1] and c[0] + c[1] > 0 else w
        tier = 0 if shares[0] > 0 else 1
        if shares[tier] == 0:
            return None
        shares[tier] -= 1
        shares[2] += 1
    return None


def search(shape: ModelShape, hw: Hardware, work: Workload, memory: int | None,
           offload_dir: str, device_memory: int | None = None, compress: str = "auto",
           free_disk: float | None = None, max_block: int = 256) -> list[Candidate]:
    """All feasible candidates, best predicted throughput first."""
    cuda = hw.device.startswith("cuda")
    free_disk = free_disk if free_disk is not None else _free_disk(offload_dir)
    choices = {"auto": (False, True), "on": (True,), "off": (False,)}[compress]
    found = []
    # without overlap only one layer is in flight: the way to fit a budget below two layers
    for micro, num, packed, overlap in itertools.product(MICRO_BATCHES, NUM_MICRO, choices,
                                                         (True, False)):
        if micro * num > max_block:
            continue
        base = _base_policy(micro, num, packed, overlap, offload_dir, memory, device_memory,
                            hw.device)
        solved = solve(shape, hw, work, base, free_disk)
        if solved is None:
            continue
        policy = _round_to_budget(shape, base, solved[0], cuda, work)
        if policy is not None:
            fp = footprint(shape, policy, cuda, policy.block_size, work.prompt_len, work.gen_len)
            found.append(Candidate(policy, predict(shape, hw, policy, work), fp.host_total))
    return sorted(found, key=lambda cand: -cand.prediction.throughput)


def _free_disk(folder: str) -> float:
    import shutil

    path = Path(folder)
    while not path.exists():
        path = path.parent
    return float(shutil.disk_usage(path).free)


# -- entry points ----------------------------------------------------------------------------------
def model_shape(path: str, dtype: torch.dtype | None = None) -> ModelShape:
    """Shapes of a checkpoint without reading its weights (the model is built on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dsinfer.injection.layers import decoder_layers

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return ModelShape.from_model(model, list(decoder_layers(model)[1]), dtype)


def plan(path: str, prompt_len: int, gen_len: int, memory: int | str,
         offload_dir: str, device_memory: int | str | None = None,
         dtype: torch.dtype | None = None, compress: str = "auto",
         hardware: Hardware | None = None) -> Candidate:
    """The best policy for a checkpoint and workload under the budgets (measures the machine
    unless `hardware` is given)."""
    from hf_dsinfer.offload.cost import measure_hardware

    shape = model_shape(path, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hw = hardware or measure_hardware(offload_dir, dtype or torch.bfloat16, device, cache=True,
                                      sample=path)
    budget = parse_bytes(memory, "memory")
    work = workload(path, shape, dtype or torch.bfloat16, device, prompt_len, gen_len, budget,
                    probe=hardware is None)
    found = search(shape, hw, work, budget, offload_dir,
                   parse_bytes(device_memory, "device_memory"), compress)
    if not found:
        from hf_dsinfer.errors import OffloadBudgetError

        raise OffloadBudgetError(
            f"hf_dsinfer plan: no placement of {path} fits memory={memory} (even one sequence "
            "with everything on disk). Fix: raise the budget or allow compression.")
    return found[0]


def workload(path: str, shape: ModelShape, dtype: torch.dtype, device: str, prompt_len: int,
             gen_len: int, memory: int | None, probe: bool = True) -> Workload:
    """The workload, with the prefill of one of the model's layers measured
    (measure_prefill_layer, ~1-3 s) when `probe` and one layer fits in half the memory
    budget; otherwise the prefill is priced by FLOPs."""
    layer_bytes = shape.layer_numel * shape.dtype_bytes
    if not probe or (memory is not None and 2 * layer_bytes > memory):
        return Workload(prompt_len, gen_len)

    return Workload(prompt_len, gen_len,
                    measure_prefill_layer(path, dtype, device, prompt_len))


def add_parser(sub) -> argparse.ArgumentParser:
    """`hf-dsinfer plan`: register the subcommand on the CLI's subparsers."""
    parser = sub.add_parser("plan", help="choose an offload policy (cost model + LP)")
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--memory", required=True, help="host RAM budget, e.g. 2.5GiB")
    parser.add_argument("--device-memory", default=None, help="GPU memory budget")
    parser.add_argument("--offload-dir", default="/tmp/hf_dsinfer_offload")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype")
    parser.add_argument("--compress", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--top", type=int, default=5, help="candidates to list")
    parser.add_argument("--probe-mib", type=int, default=512, help="disk bandwidth probe size")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure the machine again instead of reusing ~/.cache/hf_dsinfer")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from hf_dsinfer.config import parse_dtype
    from hf_dsinfer.offload.cost import measure_hardware

    dtype = parse_dtype(args.dtype)
    shape = model_shape(args.model, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hw = measure_hardware(args.offload_dir, dtype, device, args.probe_mib,
                          cache=not args.remeasure, sample=args.model)
    budget = parse_bytes(args.memory, "memory")
    work = workload(args.model, shape, dtype, device, args.prompt_len, args.gen_len, budget)
    found = search(shape, hw, work, budget, args.offload_dir,
                   parse_bytes(args.device_memory, "device_memory"), args.compress)
    print(describe_hardware(hw))
    if work.prefill_layer_s is not None:
        print(f"measured prefill of one decoder layer, one sequence of {work.prompt_len} tokens: "
              f"{work.prefill_layer_s * 1e3:.1f} ms")
    if not found:
        print(f"no feasible policy under memory={args.memory}")
        return 1
    print(format_candidates(found[: args.top]))
    best = found[0]
    print("\nchosen policy (pass as dsinfer={'offload': ...}):")
    print({k: v for k, v in best.policy.to_dict().items() if v is not None})
    p = best.prediction
    print(f"predicted: prefill {p.prefill_s:.1f} s, decode {p.decode_s:.1f} s, total "
          f"{p.total_s:.1f} s for {p.batch} x {work.gen_len} tokens -> {p.throughput:.2f} "
          f"tok/s ({p.decode_throughput:.2f} tok/s in decode)")
    return 0


def describe_hardware(hw: Hardware) -> str:
    return (f"measured {hw.device}: matmul {hw.flops / 1e12:.2f} TFLOP/s, memory "
            f"{hw.memory_bw / 1e9:.1f} GB/s, disk read {hw.disk_read / 1e9:.2f} GB/s, write "
            f"{hw.disk_write / 1e9:.2f} GB/s, 4-bit decode {hw.decompress / 1e9:.2f} GB/s, "
            f"int4 matmul {hw.int4_mm / 1e9:.1f} G weight-rows/s, 4-bit KV decode "
            f"{hw.kv_decompress / 1e9:.2f} GB/s, decode attention {hw.attn_decode / 1e9:.1f} GB/s"
            + (f", over 4-bit KV {hw.attn_int4 / 1e9:.2f} GB/s of codes"
               if hw.attn_int4 != float("inf") else ""))


def format_candidates(found: list[Candidate]) -> str:
    rows = [("| block | weights % d/c/disk | cache % d/c/disk | 4-bit | overlap | pred. tok/s | "
            "prefill s | decode s | host RAM |"),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cand in found:
        pol, pred = cand.policy, cand.prediction
        packed = [what for what, on in (("weights", pol.compress_weights),
                                        ("KV", pol.compress_cache)) if on]
        rows.append(
            f"| {pol.micro_batch_size} x {pol.num_micro_batches} | "
            f"{'/'.join(f'{v:g}' for v in pol.weights)} | "
            f"{'/'.join(f'{v:g}' for v in pol.cache)} | {' + '.join(packed) or 'no'} | "
            f"{'yes' if pol.overlap else 'no'} | {pred.throughput:.2f} | {pred.prefill_s:.1f} | "
            f"{pred.decode_s:.1f} | {format_bytes(cand.host_bytes)} |")
    return "\n".join(rows)


# -- calibration: the model's own layer, injected and timed ------------------------------------
def measure_prefill_layer(model: str | Path | object, dtype: torch.dtype, device: str,
                          prompt_len: int, reps: int = 3) -> float:
    """Seconds of one of the model's own decoder layers prefilling one sequence of `prompt_len`
    tokens, as the engine runs it (the fused block where one is injected, else HF's).

    `model`: a checkpoint folder or a transformers config. A one-layer copy of the model (random
    weights, a vocabulary cut to the special tokens) is built, injected and run; hooks on its
    layer time the layer alone. Memory: one decoder layer in `dtype` for a few seconds.
    Pricing a prefill by FLOPs at a square matmul's rate was 30-40% short on OPT-2.7B's layer
    at 512 tokens (attention, norms, bias adds and the activation are the rest), and the square
    probe itself read 1.1-2.5 TFLOP/s on this machine on different days."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dsinfer.api import init_inference
    from hf_dsinfer.injection.layers import decoder_layers

    config = (AutoConfig.from_pretrained(model) if isinstance(model, (str, Path))
              else copy.deepcopy(model))
    text = getattr(config, "get_text_config", lambda: config)()
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    special = [i for name in ("pad_token_id", "bos_token_id", "eos_token_id")
               for i in _ints(getattr(text, name, None))]
    text.vocab_size = min(text.vocab_size, max([256] + [i + 1 for i in special]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(config).to(device)
    init_inference(net, dtype=dtype, parity_check=False)
    layer = decoder_layers(net)[1][0]
    times: list[float] = []
    start = [0.0]

    def before(*_):
        synchronize(device)
        start[0] = time.perf_counter()

    def after(*_):
        synchronize(device)
        times.append(time.perf_counter() - start[0])

    handles = [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    ids = torch.randint(0, text.vocab_size, (1, prompt_len), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    try:
        with torch.inference_mode():
            for _ in range(reps + 1):  # the first is a warm-up
                net(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return statistics.median(times[1:])

def _ints(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, (list, tuple)) else []
