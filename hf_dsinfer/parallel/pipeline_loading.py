"""`from_pretrained(path, dsinfer={"pp_size": P, ...})`: each rank reads only its stage.

The model is built on meta (loading.build_on_meta), the stages are planned on the meta shapes
(pipeline.plan_stages), the blocks of other stages are replaced by placeholders, and the
sharded loader reads the rest: this stage's blocks (sliced too under tp_size > 1), the
embedding on the first stage, lm_head on the last, and the small modules outside the layers.
MoE checkpoints that store one tensor per expert are read through stacked_experts (the stage's
layers' experts stacked as transformers stacks them; ep_size then keeps this rank's share).
The parity gate gets unsharded references of this stage's first block of each class.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from hf_dsinfer import state
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.injection.layers import layers_path
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.injection.policy import Policy
from hf_dsinfer.parallel.groups import tensor_parallel_group
from hf_dsinfer.parallel.loading import (
    _HUB_KEYS,
    CheckpointReader,
    _load_generation_config,
    _read_full,
    _refuse_unhonoured,
    build_on_meta,
    checkpoint_keys,
    load_shards,
    safetensors_folder,
)
from hf_dsinfer.parallel.parity import build_references
from hf_dsinfer.parallel.pipeline import (
    StagePlan,
    StageRunner,
    layer_list,
    pipeline_ranks,
    place_boundaries,
    plan_stages,
    stub_parameters,
    unheld_parameters,
)
from hf_dsinfer.parallel.stacked_experts import StackedExpertReader, stacked_keys


def load_pipeline_parallel(original: Any, cls: type, args: tuple, kwargs: dict[str, Any],
                           config: DSInferConfig) -> nn.Module:
    """The `from_pretrained` of a pipeline-parallel model (called by the dsinfer= shim, which
    then injects it): this rank's stage where the checkpoint allows, else the whole model."""
    tp = tensor_parallel_group(config.tp_size)  # fail before reading anything
    ranks = pipeline_ranks(config.pp_size, config.tp_size, config.pp_timeout_s,
                           config.ep_size)
    path = args[0] if args else kwargs.pop("pretrained_model_name_or_path")
    folder = None if kwargs.get("gguf_file") else safetensors_folder(
        path, {k: kwargs[k] for k in _HUB_KEYS if k in kwargs})
    whole = folder is None or kwargs.get("use_safetensors") is False
    model = None if whole else build_on_meta(cls, folder, kwargs, config)
    reader = None if whole else CheckpointReader(folder)
    keys = None if whole else checkpoint_keys(model, reader)
    if keys is None and not whole:  # per-expert MoE tensors: read this stage's experts only
        found = stacked_keys(model, reader)
        if found is not None:
            keys, reader = found
            if config.ep_size > 1:  # its rank in the stage's EP group (parallel.expert)
                width = config.tp_size * config.ep_size
                reader.keep_share(config.ep_size, (dist.get_rank() % width) // config.tp_size)
    if keys is None:
        if not whole:
            warnings.warn(
                f"hf_dsinfer: {folder} stores tensors that transformers converts while loading, "
                "which cannot be read per stage: every rank loads the whole model and keeps its "
                "stage, so its peak memory is the whole model's.", stacklevel=3)
        model = original(cls, *((path,) + tuple(args[1:])), **kwargs)
        return model
    _refuse_unhonoured(kwargs)
    policy = find_policy(model)
    _, layers = layer_list(model, policy)
    plan = plan_stages(model, list(layers), config.pp_size)
    own = plan.layers[ranks.stage]
    if config.parity_check:  # full weights of this stage's first block of each class
        blocks = [(f"{_}", layers[i]) for _, i in _paths(model, policy, own)]
        refs = build_references(model, policy, lambda name: _read_full(reader, keys, name, tp),
                                blocks)
        state.put(model, "references", refs)
    unheld = unheld_parameters(model, plan, ranks.stage)
    # the runner is attached when the stage is wired (pipeline_parallelize)
    place_boundaries(layers, plan, ranks.stage, policy.returns_tuple,
                     StageRunner(ranks, plan, policy))
    load_shards(model, reader, keys, tp, skip=frozenset(unheld))
    stub_parameters(model, unheld)
    _load_generation_config(model, folder)
    if isinstance(reader, StackedExpertReader):
        plan = dataclasses.replace(plan, expert_reads=tuple(reader.reads))
    state.put(model, "pp_stages", plan)
    return model.eval()


def _paths(model: nn.Module, policy: Policy, own: range) -> list[tuple[str, int]]:
    prefix = layers_path(model, policy)
    return [(f"{prefix}.{i}", i) for i in own]


__all__ = ["StagePlan", "load_pipeline_parallel"]
