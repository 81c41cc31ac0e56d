"""y = x @ w + bias for a weight stored [in, out]: the layout gpt-oss keeps its experts in
(`x @ gate_up_proj[e] + gate_up_proj_bias[e]`), the transpose of nn.Linear's.

Shapes:
    x     [..., in]   flattened to M rows
    w     [in, out]   row-major (contiguous)
    bias  [out] or None
    out   [..., out]  dtype of x

matmul_kn_ref: HF's two ops, `x @ w` then `+ bias` (in bf16: two roundings).
matmul_kn_cpu: bf16 rows, up to KN_MAX_ROWS of them, on the native kernel (csrc/cpu_experts.c),
    which streams the weight's rows once at the memory's pace; decode reads each routed
    expert's weights for one row, where oneDNN's GEMM reads this layout at a fraction of it.
    Same roundings as the reference; the fp32 sums may differ in their last bits (another
    order), so bf16 outputs may differ by one unit in the last place. Anything else (fp32,
    more rows, a strided weight, out % 16 != 0, no native library): the reference.
There is no Triton kernel: on GPUs the reference is cuBLAS, which reads either layout at speed.
"""

from __future__ import annotations

import torch

from hf_dsinfer.kernels import _dispatch, _native

# Rows up to which bf16 calls take the native kernel: decode's rows per expert. Each row adds
# a multiply-add per weight element on the same stream of weight reads; prefill's hundreds of
# rows per expert are compute bound, where oneDNN's blocked GEMM wins.
KN_MAX_ROWS = 4


def matmul_kn_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    y = x @ w
    return y if bias is None else y + bias


def _native_fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= KN_MAX_ROWS and x.device.type == "cpu" and w.dim() == 2
            and x.dtype == w.dtype == torch.bfloat16 and w.is_contiguous()
            and w.shape[1] % 16 == 0 and not torch.compiler.is_compiling()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def matmul_kn_cpu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    lib = _native.lib("bf16_gemv") if _native_fits(x, w, bias) else None
    if lib is None:
        return matmul_kn_ref(x, w, bias)
    return _native_matmul_kn(lib, x, w, bias)


def _native_matmul_kn(lib, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """x @ w + bias by csrc/cpu_experts.c's hfd_matmul_kn_bf16."""
    k, n = w.shape
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    y = rows.new_empty(rows.shape[0], n)
    acc = torch.empty(rows.shape[0], n, dtype=torch.float32)  # the kernel's fp32 sums
    code = lib.hfd_matmul_kn_bf16(rows.data_ptr(), w.data_ptr(),
                                  None if bias is None else bias.data_ptr(), y.data_ptr(),
                                  acc.data_ptr(), rows.shape[0], k, n, torch.get_num_threads())
    if code:
        _native.check(code, "hfd_matmul_kn_bf16")
    return y.view(*x.shape[:-1], n)


def matmul_kn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
              backend: str | None = None) -> torch.Tensor:
    """x @ w + bias, w stored [in, out], with the kernel chosen by device, dtype and rows."""
    fn = _dispatch.pick(backend, x.device, ref=matmul_kn_ref, cpu_fn=matmul_kn_cpu)
    return fn(x, w, bias)
