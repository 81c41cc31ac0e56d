"""Tensor parallelism: process groups and collectives (groups.py), slicing arithmetic
(slicing.py), per-family plans (plan.py), sharding + wiring of an injected model (tensor.py),
sharded loading from safetensors (loading.py) and its parity gate (parity.py)."""

from hf_dsinfer.parallel.groups import (
    RankGroup,
    TensorParallelError,
    rank_group,
    tensor_parallel_group,
)

__all__ = ["RankGroup", "TensorParallelError", "rank_group", "tensor_parallel_group"]
