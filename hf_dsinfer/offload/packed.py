"""4-bit linears of an offloaded model that compute on their packed codes (CPU compute device).

A compressed nn.Linear weight is stored (in RAM or in the disk tier) in torch's CPU int4 layout
with its (scale, zero) pairs in the compute dtype, not as FlexGen's min-max codes, so that a
decode step multiplies by the codes as they were read: `_weight_int4pack_mm_for_cpu` reads half
a byte per weight, where dequantizing first costs several passes over the dense weight (~0.2 GB/s
of bf16 output here with torch's element-wise ops, slower than reading the dense weight from
disk). Prefill (more rows than QUANT_PACK_MAX_ROWS) dequantizes a chunk of output rows at a time
inside the matmul. The quantization is the same min-max groups along the input dim: W = q * scale
+ min = (q - 8) * scale + (min + 8 * scale).

`PackedInt4Linear` replaces such an nn.Linear in its parent; the offload engine binds its codes
(`bind`) while the layer runs and drops them after (`unbind`). It subclasses QuantizedLinear so
that the fused blocks call its `matmul`, and HF forwards call it like any linear.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.kernels.quant import (
    dequantize_int4pack_rows,
    linear_int4pack_cpu,
    quantize_int4,
)


class PackedWeight(NamedTuple):
    codes: torch.Tensor  # [out, in // 2] uint8, torch's CPU int4 layout
    scales_zeros: torch.Tensor  # [in // group, out, 2] in the compute dtype


def pack_weight(weight: torch.Tensor, group_size: int) -> PackedWeight:
    """[out, in] weight -> min-max 4-bit groups along `in`, in torch's CPU int4 layout."""
    q = quantize_int4(weight, group_size, torch_layout=True)
    return PackedWeight(q.cpu_packed, q.cpu_scales_zeros)


class PackedInt4Linear(QuantizedLinear):
    """y = x @ W.T + b with W bound as a PackedWeight (see the module docstring)."""

    def __init__(self, linear: nn.Linear, group_size: int):
        # QuantizedLinear's buffers and weight tuple are not used (codes come and go): only the
        # type, which the fused blocks route to matmul, and the methods overridden below
        nn.Module.__init__(self)
        self.group_size = group_size
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight_codes: PackedWeight | None = None
        self.dense: torch.Tensor | None = None  # [out, in] while a prefill runs

    def bind(self, weight: PackedWeight) -> None:
        self.weight_codes = weight

    def unbind(self) -> None:
        self.weight_codes = None
        self.dense = None

    def materialize(self, dtype: torch.dtype) -> None:
        """Dequantize the whole weight once, for the many-row matmuls of a prefill (all its
        micro-batches share it): one pass over the layer instead of one per micro-batch."""
        codes, scales_zeros = self.weight_codes
        self.dense = dequantize_int4pack_rows(codes, scales_zeros, self.group_size, dtype, 0,
                                              self.out_features)

    @property
    def quantized(self):
        raise NotImplementedError("PackedInt4Linear holds torch's CPU int4 layout, not an "
                                  "Int4Weight")

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        if self.weight_codes is None:
            raise RuntimeError("PackedInt4Linear: called while its offloaded codes are not "
                               "loaded (outside the offloaded layer's forward)")
        bias = self.bias if with_bias else None
        if self.dense is not None:
            return F.linear(x, self.dense, bias)
        return linear_int4pack_cpu(x, *self.weight_codes, self.group_size, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits=4 "
                f"(torch CPU int4 layout), group_size={self.group_size}, offloaded")


def swap_in_packed(block: nn.Module, names: list[str], group_size: int) -> None:
    """Replace the nn.Linear owning each weight name in `block` by a PackedInt4Linear."""
    for name in names:
        path = name.rpartition(".")[0]
        parent_path, _, attr = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        linear = getattr(parent, attr)
        if isinstance(linear, nn.Linear):
            setattr(parent, attr, PackedInt4Linear(linear, group_size))
