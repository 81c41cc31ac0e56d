"""Pure tensor ops used by the fused modules: one file per op family.

Each file follows the same order: `<op>_ref` (plain torch, HF numerics, the fallback), the
Triton kernels defined inside a `_kernels()` factory (Triton is imported there, on first use:
the package imports without it), `<op>_triton` (the launcher), `<op>_cpu` (a CPU fast path
where one beats torch's op), then the public `<op>(..., backend=None)` that dispatches (see
`_dispatch.py`). No nn.Module and no config objects live here.
"""

from hf_dsinfer.kernels._dispatch import BACKENDS, ENV_VAR, resolve, triton_available

__all__ = ["BACKENDS", "ENV_VAR", "resolve", "triton_available"]
