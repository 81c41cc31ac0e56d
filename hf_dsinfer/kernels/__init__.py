"""Pure tensor ops used by the fused modules: one file per op family.

Each file follows the same order: `<op>_ref` (plain torch, HF numerics, the fallback),
`_<op>_kernel` (Triton), `<op>_triton` (its launcher), `<op>_cpu` (a CPU fast path where torch
has a better primitive), then the public `<op>(..., backend=None)` that dispatches
(see `_dispatch.py`). No nn.Module and no config objects live here; Triton is imported lazily.
"""

from hf_dsinfer.kernels._dispatch import BACKENDS, ENV_VAR, resolve, triton_available

__all__ = ["BACKENDS", "ENV_VAR", "resolve", "triton_available"]
