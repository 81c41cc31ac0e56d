"""The expert MLPs alone: each CPU path of kernels/moe.py at a given number of rows per expert.

All experts active with the same row count, bf16, weights of several layers cycled so they come
from DRAM (one layer's experts would stay in this VM's 480 MB L3 between repetitions), paths
interleaved round by round, medians in ms. The thresholds in kernels/moe.py
(_NATIVE_MAX_ROWS_PER_EXPERT, _LOOP_MIN_ROWS_PER_EXPERT) are read off this table.

    python benchmarks/moe_experts.py                      # hidden 1024, intermediate 3584, 8 experts
    python benchmarks/moe_experts.py --rows 1 4 16 64     # other rows per expert
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_dsinfer import settings
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import moe as M


def paths(lib) -> dict:
    def native(amx: str):
        def run(xs, gu, d, offs):
            with settings.use(amx=amx == "1"):
                return M._native_moe_rows(lib, xs, gu, d, offs, xs.shape[0])
        return run

    out = {}
    if lib is not None:
        if _native.amx_available():
            out["native AMX"] = native("1")
        out["native AVX-512"] = native("0")
    out["F.grouped_mm"] = lambda xs, gu, d, offs: M._grouped_rows_gmm(xs, gu, d, offs, "silu")
    out["oneDNN pair per expert"] = lambda xs, gu, d, offs: M._grouped_rows_loop(
        xs, gu, d, offs.tolist(), "silu", kernels=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 96, 128])
    ap.add_argument("--layers", type=int, default=4, help="weight sets cycled")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    sets = [((torch.randn(e, 2 * i, h) * 0.02).bfloat16(), (torch.randn(e, h, i) * 0.02).bfloat16())
            for _ in range(args.layers)]
    runs = paths(_native.lib())
    print(f"experts {e}, hidden {h}, intermediate {i}, bf16, {torch.get_num_threads()} threads, "
          f"{args.layers} weight sets cycled ({args.layers * sets[0][0].nbytes * 1.5 / 1e6:.0f} MB)")
    print("| rows / expert | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    gbytes = 3 * e * h * i * 2 / 1e9
    for n in args.rows:
        offs = torch.arange(e + 1) * n
        xs = torch.randn(e * n, h).bfloat16()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rep in range(args.reps):
            gu, d = sets[rep % len(sets)]
            for name, fn in runs.items():
                start = time.perf_counter()
                fn(xs, gu, d, offs)
                times[name].append(time.perf_counter() - start)
        cells = [f"{statistics.median(t) * 1e3:.2f} ms ({gbytes / statistics.median(t):.1f} GB/s)"
                 for t in times.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
