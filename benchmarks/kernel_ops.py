"""Kernel benchmark: every op's fast path against its unfused torch reference, in one run.

Prints a Markdown table: op | shape | dtype | provider | time | GB/s or TFLOP/s | speedup over
the reference, plus a memory-read bandwidth measured in the same run (sum of a 1 GiB tensor) so
each GB/s figure is also shown as a fraction of what this machine can read. Every output is
checked against the reference before it is timed. Weight-bound cases cycle through several
distinct matrices whose total exceeds the 480 MB L3, so they are read from DRAM.

    python benchmarks/kernel_ops.py            # full shapes (8192x8192 headline, MoE 16/2048 tokens)
    python benchmarks/kernel_ops.py --quick    # small shapes, seconds
    python benchmarks/kernel_ops.py --device cuda   # time the Triton kernels on a GPU
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

import torch

from hf_dsinfer.hardware import median_time, read_bandwidth
from hf_dsinfer.kernels import moe, quant
from hf_dsinfer.kernels.linear import linear, linear_ref


class Case(NamedTuple):
    op: str
    shape: str
    dtype: torch.dtype
    ref: Callable[[int], torch.Tensor]  # call i uses the i-th operand set (cycled)
    fast: Callable[[int], torch.Tensor]
    provider: str
    bytes_moved: float  # per call, for GB/s (0: report TFLOP/s instead)
    flops: float
    atol: float


def _check(case: Case) -> None:
    got, ref = case.fast(1), case.ref(1)
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    if err > case.atol * max(scale, 1.0):
        raise AssertionError(f"{case.op} {case.provider}: max |err| {err:.3g} vs ref")


def linear_cases(n: int, n_mats: int, device: str, backend: str) -> list[Case]:
    """bf16 batch-1 linear: chosen small-batch path, int8 and int4 weight-only, vs F.linear."""
    dt = torch.bfloat16
    x = torch.randn(1, n, dtype=dt, device=device)
    ws = [torch.randn(n, n, dtype=dt, device=device) * 0.02 for _ in range(n_mats)]
    w8 = [quant.quantize_int8(w) for w in ws]
    n8 = 2 * n_mats  # int8 / int4 matrices are smaller: use more to stay beyond the L3
    w8 += [quant.quantize_int8(torch.randn(n, n, dtype=dt, device=device) * 0.02)
           for _ in range(n8 - n_mats)]
    w4 = [quant.quantize_int4(ws[i], 128) for i in range(n_mats)]
    w4 += [quant.quantize_int4(torch.randn(n, n, dtype=dt, device=device) * 0.02, 128)
           for _ in range(4 * n_mats - len(w4))]
    shape = f"1x{n} @ {n}x{n} ({len(ws)}/{len(w8)}/{len(w4)} mats)"
    ref = lambda i: linear_ref(x, ws[i % len(ws)])
    return [
        Case("linear", shape, dt, ref, lambda i: linear(x, ws[i % len(ws)], backend=backend),
             backend, n * n * 2, 0, 2e-2),
        Case("linear_int8", shape, dt, lambda i: linear_ref(x, ws[i % len(ws)]),
             lambda i: quant.linear_int8(x, w8[i % len(w8)], backend=backend),
             backend, n * n * 1, 0, 5e-2),
        Case("linear_int4 g128", shape, dt, lambda i: linear_ref(x, ws[i % len(ws)]),
             lambda i: quant.linear_int4(x, w4[i % len(w4)], backend=backend),
             backend, n * n * 0.5 + n * n / 128 * 4, 0, 2e-1),
    ]


def prefill_linear_case(m: int, n: int, device: str, backend: str) -> Case:
    dt = torch.bfloat16
    x, w = torch.randn(m, n, dtype=dt, device=device), torch.randn(n, n, dtype=dt, device=device)
    return Case("linear", f"{m}x{n} @ {n}x{n}", dt, lambda i: linear_ref(x, w),
                lambda i: linear(x, w, backend=backend), backend, 0, 2 * m * n * n, 2e-2)


def moe_case(tokens: int, h: int, inter: int, n_exp: int, k: int, device: str,
             backend: str) -> Case:
    dt = torch.bfloat16
    hidden = torch.randn(tokens, h, dtype=dt, device=device)
    gate_up = torch.randn(n_exp, 2 * inter, h, dtype=dt, device=device) * 0.02
    down = torch.randn(n_exp, h, inter, dtype=dt, device=device) * 0.02
    logits = torch.randn(tokens, n_exp, device=device)
    w_ref, ids_ref = moe.topk_gating_ref(logits, k, True, True)

    def fast(i: int) -> torch.Tensor:
        w, ids = moe.topk_gating(logits, k, softmax_first=True, renormalize=True,
                                 backend=backend)
        return moe.grouped_expert_mlp(hidden, gate_up, down, w, ids, backend=backend)

    def ref(i: int) -> torch.Tensor:
        return moe.grouped_expert_mlp_ref(hidden, gate_up, down, w_ref, ids_ref)

    used = min(n_exp, tokens * k)
    bytes_moved = used * 3 * inter * h * 2 if tokens * k < 64 else 0
    return Case("moe gating+experts", f"T={tokens} H={h} I={inter} E={n_exp} k={k}", dt, ref,
                fast, backend, bytes_moved, 2 * tokens * k * 3 * h * inter, 5e-2)


def other_cases(device: str, backend: str, tokens: int) -> list[Case]:
    """Norms / attention from the sibling op files, when they are present."""
    cases = []
    try:
        from hf_dsinfer.kernels import attention, norms
    except ImportError:
        return cases
    dt, h = torch.bfloat16, 4096
    x, res = (torch.randn(tokens, h, dtype=dt, device=device) for _ in range(2))
    wn = torch.randn(h, dtype=dt, device=device)
    cases.append(Case(
        "rms_norm+residual", f"{tokens}x{h}", dt,
        lambda i: norms.rms_norm_ref(x, wn, 1e-6, res, None)[0],
        lambda i: norms.rms_norm(x, wn, 1e-6, res, backend=backend)[0],
        backend, 3 * x.numel() * 2, 0, 2e-2))
    q = torch.randn(1, 32, tokens, 128, dtype=dt, device=device)
    kv = torch.randn(1, 8, tokens, 128, dtype=dt, device=device)
    cases.append(Case(
        "attention prefill causal GQA", f"1x32/8x{tokens}x128", dt,
        lambda i: attention.attention_ref(q, kv, kv, scale=128**-0.5, causal=True),
        lambda i: attention.attention(q, kv, kv, scale=128**-0.5, causal=True, backend=backend),
        backend, 0, 4 * 32 * tokens * tokens * 128 / 2, 3e-2))
    return cases


def run_case(case: Case, reps: int, device: str, bandwidth: float) -> list[str]:
    _check(case)
    t_ref = median_time(case.ref, reps, device)
    t_fast = median_time(case.fast, reps, device)
    rows = []
    for provider, t in (("torch ref", t_ref), (case.provider, t_fast)):
        if case.bytes_moved:
            gbs = case.bytes_moved / t / 1e9
            rate = f"{gbs:.1f} GB/s ({gbs / bandwidth:.0%} of read bw)"
        else:
            rate = f"{case.flops / t / 1e12:.2f} TFLOP/s"
        speedup = f"{t_ref / t:.2f}x"
        dtype = str(case.dtype).replace("torch.", "")
        rows.append(f"| {case.op} | {case.shape} | {dtype} | {provider} | {t * 1e3:.3f} ms | "
                    f"{rate} | {speedup} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, seconds")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here. Fix: run on a GPU machine.")
    backend = "triton" if device == "cuda" else "cpu"
    torch.manual_seed(0)
    n, mats, reps = (2048, 2, 5) if args.quick else (8192, 5, 15)
    bandwidth = read_bandwidth(device, 0.25 if args.quick else 1.0)
    cases = linear_cases(n, mats, device, backend)
    cases.append(prefill_linear_case(64 if args.quick else 512, n // 2, device, backend))
    moe_shape = (256, 512, 4, 2) if args.quick else (1024, 2816, 8, 2)
    cases += [moe_case(t, *moe_shape, device, backend) for t in (16, 64 if args.quick else 2048)]
    cases += other_cases(device, backend, 128 if args.quick else 1024)
    print(f"memory-read bandwidth (sum of a large fp32 tensor): {bandwidth:.1f} GB/s\n")
    print("| op | shape | dtype | provider | time | GB/s or TFLOP/s | speedup vs ref |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        for row in run_case(case, reps if case.bytes_moved else max(3, reps // 3), device,
                            bandwidth):
            print(row, flush=True)


if __name__ == "__main__":
    main()
