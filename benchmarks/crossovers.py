"""Row crossovers of the CPU quantized linears, per ISA tier: the data of kernels/crossovers.py.

For each tier this CPU runs, in a process of its own that pretends a CPU whose best tier it is
(as tests/kernels/test_native_tiers.py does: `_native.MIN_TIER` then decides what runs natively)
with torch's own kernels capped to match (ATEN_CPU_CAPABILITY: default below avx2, avx2,
avx512; and oneDNN's, ONEDNN_MAX_CPU_ISA), it times the candidate paths of an int8 and an int4 linear over a range of row counts:

    int8: native GEMV (csrc/cpu_quant.c, on row tiles) | the native panel kernel
          (csrc/cpu_qgemm.c, on row tiles) | torch's _weight_int8pack_mm |
          dequantize 512 rows at a time + F.linear (the native dequantization where that tier
          runs it, else torch's element-wise ops)
    int4: native int4 linear (csrc/cpu_decode.c, on row tiles) | the native panel kernel
          (csrc/cpu_qgemm.c, on row tiles) | torch's _weight_int4pack_mm_for_cpu (where its
          probe passed) | dequantize + F.linear
    bf16: the native bf16 panel kernel (csrc/cpu_qgemm.c: hfd_gemm_bf16, from its MIN_TIER) |
          F.linear, or fp32 GEMMs on converted weight chunks where linear_cpu runs those (many
          rows at a tier without bf16 dot products), on the bf16 weight as the model stores it
          (huge pages: streamed_copy)

Each path is checked against the torch reference before it is timed. The repeats are
interleaved (every path and row count once per round, weights cycled past the L3 cache) and
the medians printed as a Markdown table per tier, then the crossovers: for each comparison the
largest row count of the grid at which the first path is at least as fast as the others,
before it first loses at two row counts in a row (0: slower from one row). `--json PATH`
writes the times and crossovers.

    python benchmarks/crossovers.py                        # every tier this CPU has
    python benchmarks/crossovers.py --tiers avx2 --reps 7  # one tier, more repeats

A tier above the CPU's own is refused. On an AMX CPU the amx tier also times the int4 AMX
kernel (csrc/cpu_moe.c: hfd_int4_amx; its bound amx_int4_max_rows) and, for reference, the bf16
AMX linear (hfd_linear_bf16, which takes 2-256 bf16 rows there); the int8 AMX kernel is not
timed here (its comparisons are in the comments of kernels/quant.py). Run it on a quiet
machine: the threads of the native kernels and of torch share the cores, and on a loaded one
the medians of 2+ threads are the scheduler's (use --threads 1 there, and say so).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# torch's dispatch for a CPU of each tier (ATEN_CPU_CAPABILITY)
ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx2_vnni": "avx2", "avx512": "avx512",
                   "avx512_bf16": "avx512", "amx": "avx512"}
# and oneDNN's, which F.linear's bf16 GEMMs run on and ATEN_CPU_CAPABILITY does not reach
# (ONEDNN_MAX_CPU_ISA): without it the lower tiers' F.linear kept this CPU's AVX-512 GEMMs
ONEDNN_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx2_vnni": "AVX2_VNNI",
              "avx512": "AVX512_CORE_VNNI",
              "avx512_bf16": "AVX512_CORE_BF16", "amx": "DEFAULT"}
# (op, the path that wins at few rows, the paths it hands over to) per field of
# kernels/crossovers.py. The native int4 kernel reads codes of which torch's kernel has no copy
# (tiles where it runs by default, the offload engine's portable codes everywhere), so its only
# alternative is dequantize + GEMM.
# The panel kernels take over where the dot-product kernels stop: their bound is found over the
# row counts past that one (field: the field it follows; measured in this run, else the tier's
# value in kernels/crossovers.py: the bf16 GEMV's, which this script does not time).
AFTER = {"int8_gemm_max_rows": "int8_gemv_max_rows", "int4_gemm_max_rows": "int4_native_max_rows",
         "bf16_gemm_max_rows": "bf16_gemv_max_rows",
         "amx_int4_max_rows": "int4_native_max_rows"}
COMPARISONS = {
    "int8_gemv_max_rows": ("int8", "native", ("gemm", "int8pack", "dequant")),
    "int8_gemm_max_rows": ("int8", "gemm", ("int8pack", "dequant")),
    "int8_pack_max_rows": ("int8", "int8pack", ("dequant",)),
    "int4_native_max_rows": ("int4", "native", ("gemm", "amx", "dequant")),
    "amx_int4_max_rows": ("int4", "amx", ("gemm", "dequant")),
    "int4_gemm_max_rows": ("int4", "gemm", ("dequant",)),
    "int4_pack_max_rows": ("int4", "int4pack", ("dequant",)),
    "bf16_gemm_max_rows": ("bf16", "gemm", ("flinear",)),
}


def _paths(tier: str, out_f: int, in_f: int, copies: int, group: int):
    """{(op, path): fn(x2, i)} for the paths that run here, after checking each against the
    reference; weights cycled over `copies` distinct matrices."""
    from hf_dsinfer.kernels import _native
    from hf_dsinfer.kernels import linear as L
    from hf_dsinfer.kernels import quant as Q

    _native.cpu_tier = lambda: tier  # this process pretends a CPU whose best tier is `tier`
    lib = _native._load(tier)
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16() for _ in range(copies)]
    w8 = [Q.quantize_int8(w) for w in ws]  # as this tier stores them (tiles where gemv runs)
    tiles8 = [w if w.tiled else w._replace(qweight=Q.tile_rows(w.qweight), tiled=True)
              for w in w8]
    w4 = [Q.quantize_int4(w, group, portable=True) for w in ws]
    stored4 = [Q.quantize_int4(w, group) for w in ws]  # as this tier stores them (tiles, or not)
    tiles4 = [w._replace(packed=Q.tile_rows(Q.int4_super_order(w.packed)), tiled=True)
              for w in w4]
    torch4 = [Q._torch_int4_copy(Q.unpack_int4(w.packed), w.scales, w.mins) for w in w4]
    has4 = Q.verified(Q.INT4PACK_MM, torch.bfloat16, Q._probe_int4pack_mm)
    has8 = Q.verified(Q.INT8PACK_MM, torch.bfloat16, Q._probe_int8pack_mm)
    dense = [_native.streamed_copy(w) for w in ws]
    paths = {
        # what linear_cpu runs past the native kernels: fp32 GEMMs for many bf16 rows at a tier
        # without bf16 dot products (kernels/linear.py: bf16_gemm_in_fp32), else F.linear
        ("bf16", "flinear"): lambda x, i: (L._linear_fp32(x, dense[i], None)
                                           if L.bf16_gemm_in_fp32(x, x.shape[0])
                                           else torch.nn.functional.linear(x, dense[i])),
        ("int8", "native"): lambda x, i: Q._native_int8(lib, x, tiles8[i], None),
        ("int8", "dequant"): lambda x, i: Q._chunked_dequant_linear(
            x, out_f, functools.partial(Q._int8_rows, w8[i], x.dtype), None),
        ("int4", "native"): lambda x, i: Q._native_int4(x, tiles4[i]).to(x.dtype),
        ("int4", "dequant"): lambda x, i: Q._chunked_dequant_linear(
            x, out_f, functools.partial(Q.dequantize_int4_rows, stored4[i], x.dtype), None),
    }
    if _native.lib("panel") is not None:  # from its MIN_TIER on
        paths["int4", "gemm"] = lambda x, i: Q._native_int4_gemm(x, tiles4[i]).to(x.dtype)
        paths["int8", "gemm"] = lambda x, i: Q._native_int8_gemm(x, tiles8[i]).to(x.dtype)
    if _native.lib("bf16_gemv") is not None:  # the panel kernel's bf16 use (its MIN_TIER)
        paths["bf16", "gemm"] = lambda x, i: L._native_gemm(lib, x, dense[i], None)
    if _native.amx_available():  # the amx tier, where the CPU grants the tiles
        paths["int4", "amx"] = lambda x, i: Q._native_int4_amx(x, tiles4[i])
        paths["bf16", "amx"] = lambda x, i: L._native_linear(lib, x, dense[i], None)
    if has8:  # as linear_int8_cpu calls it: on a row-major copy where the tier stores tiles
        paths["int8", "int8pack"] = lambda x, i: torch.ops.aten._weight_int8pack_mm(
            x, Q.int8_matrix(w8[i]).contiguous(), w8[i].scales)
    if has4:
        paths["int4", "int4pack"] = lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, torch4[i][0], group, torch4[i][1])
    x = torch.randn(3, in_f, generator=gen).bfloat16()
    refs = {"int8": Q.linear_int8_ref(x, w8[0]), "int4": Q.linear_int4_ref(x, w4[0]),
            "bf16": torch.nn.functional.linear(x.float(), ws[0].float())}
    for (op, name), fn in paths.items():
        err = (fn(x, 0).float() - refs[op].float()).abs().max().item()
        assert err <= 2e-2 * refs[op].float().abs().max().item(), f"{op} {name}: |err| {err}"
    return paths


def _child(args) -> None:
    """Time every path at every row count, interleaved; print {op: {path: {rows: ms}}} as JSON."""
    torch.set_num_threads(args.threads)
    paths = _paths(args.child, args.out, args.inp, args.copies, args.group)
    times: dict = {}
    xs = {r: torch.randn(r, args.inp).bfloat16() for r in args.rows}
    for fn in paths.values():  # warm-up: first calls build and page in
        for i in range(args.copies):
            fn(xs[min(xs)], i)
    call = 0
    for _ in range(args.reps):
        for rows in args.rows:
            for key, fn in paths.items():
                start = time.perf_counter()
                fn(xs[rows], call % args.copies)
                elapsed = time.perf_counter() - start
                times.setdefault(key, {}).setdefault(rows, []).append(elapsed * 1e3)
                call += 1
    out = {}
    for (op, name), per_rows in times.items():
        out.setdefault(op, {})[name] = {r: statistics.median(t) for r, t in per_rows.items()}
    print(json.dumps(out))


def crossover(faster: dict, others: list[dict]) -> int:
    """The largest row count of the grid at which `faster` is at most the best of `others`,
    before the first two consecutive row counts where it is slower (one slower median alone is
    taken for noise); 0: slower from the first row count on."""
    grid = sorted(faster, key=int)
    loses = [faster[r] > min(o[r] for o in others) for r in grid]
    last = 0
    for i, rows in enumerate(grid):
        if loses[i] and (i + 1 == len(grid) or loses[i + 1]):
            break
        if not loses[i]:
            last = int(rows)
    return last


def _tier_times(tier: str, args) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[tier],
           "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[tier]}
    env.pop("HF_DSINFER_ISA", None)
    cmd = [sys.executable, __file__, "--child", tier, "--reps", str(args.reps),
           "--threads", str(args.threads), "--out", str(args.out), "--inp", str(args.inp),
           "--copies", str(args.copies), "--group", str(args.group),
           "--rows", *map(str, args.rows)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"{tier}: {run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _print_tier(tier: str, times: dict, found: dict) -> None:
    print(f"\n### {tier} (ATEN_CPU_CAPABILITY={ATEN_CAPABILITY[tier]}, "
          f"ONEDNN_MAX_CPU_ISA={ONEDNN_ISA[tier]})\n")
    cols = [(op, name) for op in times for name in times[op]]
    print("| rows | " + " | ".join(f"{op} {name} ms" for op, name in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for rows in next(iter(next(iter(times.values())).values())):
        print(f"| {rows} | " + " | ".join(f"{times[op][name][rows]:.3f}" for op, name in cols)
              + " |")
    print("\n" + ", ".join(f"{k} = {v}" for k, v in found.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", nargs="*", help="default: every tier this CPU runs")
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=int, default=5632, help="output features")
    parser.add_argument("--inp", type=int, default=2048, help="input features")
    parser.add_argument("--copies", type=int, default=8, help="weights cycled (past the L3)")
    parser.add_argument("--group", type=int, default=32, help="int4 group size")
    parser.add_argument("--json", help="write the times and crossovers here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    from hf_dsinfer.kernels import _native, crossovers

    best = _native.cpu_tier()
    runnable = list(_native.runnable_tiers())
    tiers = args.tiers or runnable
    if bad := [t for t in tiers if t not in runnable]:
        raise SystemExit(f"this CPU (best tier {best}) lacks the tiers {bad}: run them on a CPU "
                         f"that has them")
    print(f"CPU: {_cpu_name()}; best tier {best}; {args.threads} threads; weight {args.out} x "
          f"{args.inp} bf16 -> int8 / int4 group {args.group}, {args.copies} copies cycled; "
          f"medians of {args.reps} interleaved repeats")
    result = {}
    for tier in tiers:
        times = _tier_times(tier, args)
        found = {}
        for name, (op, path, others) in COMPARISONS.items():
            if path not in times[op] or not any(o in times[op] for o in others):
                continue
            faster = times[op][path]
            if (before := AFTER.get(name)) is not None:  # a middle path: from where it takes over
                start = found.get(before, getattr(crossovers.TABLE[tier], before))
                faster = {r: t for r, t in faster.items() if int(r) > (start or 0)}
            found[name] = crossover(faster, [times[op][o] for o in others if o in times[op]])
        _print_tier(tier, times, found)
        result[tier] = {"times_ms": times, "crossovers": found}
    print("\n| tier | " + " | ".join(COMPARISONS) + " |")
    print("|---|" + "---:|" * len(COMPARISONS))
    for tier, res in result.items():
        print(f"| {tier} | " + " | ".join(str(res["crossovers"].get(k, "-"))
                                         for k in COMPARISONS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu_name(), "args": vars(args), "tiers": result}, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
