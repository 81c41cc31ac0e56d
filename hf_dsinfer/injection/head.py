"""The output projection (lm_head) on the kernel library's linear.

At decode time the logits projection is the largest single matrix-vector product of a step
(Llama-1.1B: 32000 x 2048, 131 MB in bf16, ~5% of the weights read per token). HF runs it as
nn.Linear's F.linear; this installs `kernels.linear` instead (torch.mv or the native GEMV for a
bf16 row on CPU; cuBLAS on CUDA, docs/gpu.md), and with `quant` on, the head is quantized to
int8 (per output channel, with the native CPU kernel; int8 also for bits=4, as llama.cpp's Q4
files keep their output matrix at 6-8 bits). A head tied to the input embedding is quantized too, into an int8
copy: the table stays for the embedding lookup, so the model grows by the int8 head (SmolLM2:
+28 MB) while every decode step reads half the bytes for its logits (a large share of a small
model's int4 step: docs/performance.md, "Behind the code"). llama.cpp's SmolLM2 Q4_1 file does the same with its
table (Q8_0).

Installed as the instance attribute `lm_head.forward` (or replaced by a QuantizedLinear), like
the blocks, so `revert` restores an unquantized head exactly. Not installed under tensor or
expert parallelism, offload, or when accelerate hooks the head (it may be offloaded).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hf_dsinfer.config import DSInferConfig, QuantConfig
from hf_dsinfer.injection.quantize import QuantizedLinear, quantize_linear
from hf_dsinfer.kernels.linear import linear


class FastHead:
    """Callable installed as `lm_head.forward`: y = kernels.linear(x, weight, bias)."""

    def __init__(self, module: nn.Linear, backend: str):
        self.module = module
        self.backend = backend
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.calls += 1
        return linear(x, self.module.weight, self.module.bias, backend=self.backend)


@dataclasses.dataclass
class HeadReport:
    path: str
    kind: str  # "linear" (FastHead installed) or "int8" (replaced by a QuantizedLinear)
    fast: FastHead | QuantizedLinear

    def describe(self) -> str:
        what = ("kernel-library linear" if self.kind == "linear"
                else "int8 weight-only (per output channel)")
        return f"output head {self.path}: {what}"


def _head_path(model: nn.Module, head: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


def install_head(model: nn.Module, config: DSInferConfig, backend: str) -> HeadReport | None:
    """Put the output projection on the kernel library (see the module docstring)."""
    if config.tp_size > 1 or config.ep_size > 1 or config.pp_size > 1 or config.offload is not None:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or hasattr(head, "_hf_hook") or head.weight.device.type == "meta":
        return None
    path = _head_path(model, head)
    if path is None:
        return None
    if config.quant is not None:
        q = quantize_linear(head, False, QuantConfig(bits=8), None, backend)
        model.set_output_embeddings(q)
        return HeadReport(path, "int8", q)
    fast = FastHead(head, backend)
    head.forward = fast
    return HeadReport(path, "linear", fast)


def uninstall_head(model: nn.Module, report: HeadReport | None) -> None:
    """Remove the FastHead (a quantized head stays quantized, as quantized blocks do)."""
    if report is None or report.kind != "linear":
        return
    head = report.fast.module
    if head.__dict__.get("forward") is report.fast:
        del head.forward
