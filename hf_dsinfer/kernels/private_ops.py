"""torch's private CPU ops, used only as black boxes that a probe has checked on this CPU.

`torch.ops.aten._weight_int4pack_mm_for_cpu` (after `_convert_weight_to_int4pack_for_cpu`),
`torch.ops.aten._weight_int8pack_mm` and `torch.ops.mkldnn._linear_pointwise` are not public
API: what they compute, and the layouts they produce, are whatever torch's dispatch picked for
this CPU (ATEN_CPU_CAPABILITY: the int4 layout differs between avx2 and avx512; code that read
it itself generated garbage on an AVX2-only machine). So the project never reads their outputs'
layouts, and before it uses one it runs a small probe once per process, per op and dtype:

    probe(dtype) -> (the op's output, the project's torch reference on the same operands)

The op is used when the relative error ||got - want|| / ||want|| is within TOLERANCE[dtype]
(a few roundings of the dtype; a wrong layout or op gives ~1), and the caller takes its
reference / dequantize path otherwise. `verdicts()` holds each result and why, for reports.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

# Relative error allowed between a private op and the reference (measured here on the probes:
# fp32 ~3e-7, fp16 ~3e-4, bf16 ~2.7e-3: the reference rounds the dequantized weight to the
# dtype, the ops accumulate from fp32 values).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}

Probe = Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]]


class Verdict(NamedTuple):
    ok: bool
    reason: str


# (op name, dtype) -> Verdict: the one piece of process state here, filled on first use.
_VERDICTS: dict[tuple[str, torch.dtype], Verdict] = {}


def verified(op: str, dtype: torch.dtype, probe: Probe) -> bool:
    """Whether torch's private `op` may be used for `dtype` in this process (see the module
    docstring); the probe runs on the first call for (op, dtype) only, and a refusal is warned
    about then (the caller's slower reference path is what runs from there on)."""
    verdict = _VERDICTS.get((op, dtype))
    if verdict is None:
        verdict = _probe_once(op, dtype, probe)
    return verdict.ok


@torch.compiler.disable
def _probe_once(op: str, dtype: torch.dtype, probe: Probe) -> Verdict:
    """judge, recorded, and warned about when refused. Always eager: traced by torch.compile
    (a compiled decode step may be the first caller), the probe would test inductor's lowering
    of the op instead of the op, and inductor refuses to lower some of these ops."""
    verdict = _VERDICTS[(op, dtype)] = judge(op, dtype, probe)
    if not verdict.ok:
        warnings.warn(f"hf_dsinfer: {verdict.reason}; using the reference path instead.",
                      RuntimeWarning, stacklevel=3)
    return verdict


def judge(op: str, dtype: torch.dtype, probe: Probe) -> Verdict:
    """Run `probe` and compare the op's output with the reference's (no caching)."""
    try:
        got, want = probe(dtype)
    except (RuntimeError, AttributeError) as err:  # op missing, or refusing this CPU / dtype
        return Verdict(False, f"torch's {op} ({dtype}) failed its probe: {err}")
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    if got.shape != want.shape:
        return Verdict(False, f"torch's {op} ({dtype}) gave shape {tuple(got.shape)}, the "
                              f"reference {tuple(want.shape)}")
    want = want.float()
    err = ((got.float() - want).norm() / want.norm().clamp(min=1e-30)).item()
    if not err <= tol:  # also refuses NaN
        return Verdict(False, f"torch's {op} ({dtype}) disagrees with the reference on this "
                              f"CPU: relative error {err:.2g} > {tol:g}")
    return Verdict(True, f"torch's {op} ({dtype}) agrees with the reference: relative error "
                         f"{err:.2g} <= {tol:g}")


def verdicts() -> dict[tuple[str, torch.dtype], Verdict]:
    """The probes run so far in this process (a copy), e.g. for explain()."""
    return dict(_VERDICTS)
