"""Sharded loading: each rank builds the model on meta and reads only its slices.

`from_pretrained(path, dsinfer={"tp_size": N})` under torchrun comes here (through the shim):
1. the config is read and the model is built with its parameters on the meta device (buffers
   such as rotary tables are computed for real: they are small and often not in checkpoints);
2. the tensor-parallel plan is made on the meta model (shapes only);
3. every parameter is read from the safetensors checkpoint through `safe_open(...).get_slice`,
   which maps the file and copies only this rank's ranges. The file is opened per tensor, so
   at most one tensor's mapped pages count towards the process's resident memory at a time;
   peak RSS tracks this rank's shard rather than the checkpoint;
4. injection runs on the sharded model (phases -> parallel.tensor.parallelize).

Checkpoints that are not local-or-cached safetensors (GGUF, .bin) are loaded whole and sliced in
place instead (each rank then briefly holds the full model).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from hf_dsinfer import state
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import TensorParallelError
from hf_dsinfer.hf.checkpoint import renamed_keys
from hf_dsinfer.injection.layers import iter_layers
from hf_dsinfer.injection.policies import find_policy
from hf_dsinfer.parallel.groups import RankGroup, tensor_parallel_group
from hf_dsinfer.parallel.parity import build_references
from hf_dsinfer.parallel.slicing import ShardSpec
from hf_dsinfer.parallel.tensor import plan_model, set_parameter

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# from_pretrained keywords the sharded loader honours; any other one is refused by name.
_HUB_KEYS = ("cache_dir", "force_download", "local_files_only", "token", "revision")
_HONOURED = {"config", "dtype", "torch_dtype", "attn_implementation", "use_safetensors",
             "trust_remote_code", *_HUB_KEYS}


class CheckpointReader:
    """Where each tensor of a safetensors checkpoint lives; reads whole tensors or slices.

    Reads go through `safe_open(...).get_slice`, which maps the file: the slices it returns are
    views of the mapping, and a slice along dim 1 strides over every row, i.e. over all of the
    tensor's pages. So a tensor is read in row blocks of about CHUNK_BYTES, each through a mapping
    that is closed right after its block is copied into the rank's own tensor: at most one block
    of mapped pages is resident at a time, and the rank keeps exactly its shard.
    """

    CHUNK_BYTES = 4 * 2**20

    def __init__(self, folder: Path):
        index = folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: folder / name for key, name in weight_map.items()}
        else:
            with safe_open(folder / SINGLE_FILE, "pt") as f:
                self.files = {key: folder / SINGLE_FILE for key in f.keys()}  # noqa: SIM118

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, spec: ShardSpec | None) -> torch.Tensor:
        with safe_open(self.files[key], "pt") as f:
            shape = f.get_slice(key).get_shape()
        if not shape:  # a scalar
            with safe_open(self.files[key], "pt") as f:
                return f.get_tensor(key).clone()
        spec = spec or ShardSpec(0, ((0, shape[0]),))
        out_shape = list(shape)
        out_shape[spec.dim] = spec.length
        out, row = None, 0
        for index in self._blocks(spec, shape):
            with safe_open(self.files[key], "pt") as f:
                piece = f.get_slice(key)
                col = 0
                for i in index:  # copy straight from the mapping: no temporary per block
                    part = piece[i]
                    if out is None:
                        out = torch.empty(out_shape, dtype=part.dtype)
                    target = out[row:row + part.shape[0]]
                    target.narrow(spec.dim, col, part.shape[spec.dim]).copy_(part) \
                        if spec.dim else target.copy_(part)
                    col += part.shape[spec.dim]
                row += part.shape[0]
        return out

    def read_whole(self, key: str) -> torch.Tensor:
        """A whole tensor backed by the file mapping: its pages are read when touched and given
        back as soon as the tensor is dropped (the parity gate's short-lived full weights; a
        malloc'd copy would stay in the heap after it is freed)."""
        with safe_open(self.files[key], "pt") as f:
            return f.get_tensor(key)

    def _blocks(self, spec: ShardSpec, shape: list[int]):
        """Per row block, the slice indices to read (several when spec.dim == 1)."""
        row_bytes = 4 * math.prod(shape[1:])
        step = max(1, self.CHUNK_BYTES // row_bytes)
        if spec.dim == 0:
            for a, b in spec.ranges:
                for r in range(a, b, step):
                    yield [(slice(r, min(b, r + step)),)]
        else:  # columns of every row
            for r in range(0, shape[0], step):
                rows = slice(r, min(shape[0], r + step))
                lead = (rows, *(slice(None),) * (spec.dim - 1))
                yield [(*lead, slice(a, b)) for a, b in spec.ranges]


def safetensors_folder(path: Any, hub: dict[str, Any]) -> Path | None:
    """Local folder holding the checkpoint's safetensors, or None when there is none."""
    folder = Path(path)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            hub = {k: v for k, v in hub.items() if k != "force_download"}
            folder = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"],
                                            **hub))
        except (OSError, ValueError):  # not a resolvable repo id: the whole-model path reports it
            return None
    if (folder / INDEX_FILE).exists() or (folder / SINGLE_FILE).exists():
        return folder
    return None


def load_tensor_parallel(original: Any, cls: type, args: tuple, kwargs: dict[str, Any],
                         config: DSInferConfig) -> nn.Module:
    """The `from_pretrained` of a tensor-parallel model (called by the dsinfer= shim, which
    then injects it): this rank's slices where the checkpoint allows, else the whole model."""
    tp = tensor_parallel_group(config.tp_size)  # fail before reading anything
    path = args[0] if args else kwargs.pop("pretrained_model_name_or_path")
    folder = None if kwargs.get("gguf_file") else safetensors_folder(
        path, {k: kwargs[k] for k in _HUB_KEYS if k in kwargs})
    if folder is None or kwargs.get("use_safetensors") is False:
        model = original(cls, *((path,) + tuple(args[1:])), **kwargs)
        return model
    _refuse_unhonoured(kwargs)
    model = build_on_meta(cls, folder, kwargs, config)
    reader = CheckpointReader(folder)
    keys = checkpoint_keys(model, reader)
    if keys is None:  # e.g. per-expert MoE tensors that transformers merges while loading
        warnings.warn(
            f"hf_dsinfer: {folder} stores tensors that transformers converts while loading "
            "(e.g. per-expert MoE weights merged into 3-D tensors), which cannot be read as "
            "slices: every rank loads the whole model and slices it in place, so its peak "
            "memory is the whole model's.", stacklevel=3)
        del model
        model = original(cls, *((path,) + tuple(args[1:])), **kwargs)
        return model
    if config.parity_check:  # full weights of one block per class, for the parity gate
        policy = find_policy(model)
        refs = build_references(model, policy, lambda name: _read_full(reader, keys, name, tp),
                                [(path, block) for path, _, block in iter_layers(model, policy)])
        state.put(model, "references", refs)
    load_shards(model, reader, keys, tp)
    _load_generation_config(model, folder)
    return model.eval()


def _refuse_unhonoured(kwargs: dict[str, Any]) -> None:
    extra = sorted(k for k, v in kwargs.items() if k not in _HONOURED and v is not None)
    if extra:
        raise TensorParallelError(
            f"from_pretrained(..., dsinfer={{'tp_size': N}}) loads only this rank's slices and "
            f"does not support {extra}. Fix: drop them (tensor parallelism and device_map are "
            "exclusive), or load with tp_size=1."
        )


def _dtype(kwargs: dict[str, Any], config: DSInferConfig, hf_config: Any) -> torch.dtype:
    from hf_dsinfer.config import parse_dtype

    asked = config.dtype or kwargs.get("dtype", kwargs.get("torch_dtype"))
    if asked is None or asked == "auto":
        asked = getattr(hf_config, "dtype", None) or torch.float32
    return parse_dtype(asked)


def build_on_meta(cls: type, folder: Path, kwargs: dict[str, Any],
                  config: DSInferConfig) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    hf_config = kwargs.get("config")
    if hf_config is None or isinstance(hf_config, (str, os.PathLike)):
        hf_config = AutoConfig.from_pretrained(hf_config or folder)
    extra = {"attn_implementation": kwargs["attn_implementation"]} \
        if kwargs.get("attn_implementation") else {}
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(hf_config, dtype=_dtype(kwargs, config, hf_config), **extra)
    model.tie_weights()
    if find_policy(model) is None:
        raise TensorParallelError(
            f"tp_size={config.tp_size}: hf_dsinfer has no policy for {type(model).__name__}, so "
            "it cannot slice it. Fix: use a supported family, or tp_size=1.")
    return model


def checkpoint_keys(model: nn.Module, reader: CheckpointReader) -> dict[str, str] | None:
    """model tensor name -> checkpoint key, through transformers' own key renamings (legacy
    names such as GPT-NeoX's `embed_out`, a missing or extra base-model prefix). None when some
    key needs a weight *converter* (merging per-expert tensors, splitting fused ones): such a
    checkpoint cannot be read as slices."""
    mapping = {}
    for key, name, converter in renamed_keys(model, reader.files):
        if converter is not None:
            return None
        mapping[name] = key
    return mapping


def _read_full(reader: CheckpointReader, keys: dict[str, str], name: str,
               tp: RankGroup) -> torch.Tensor:
    if name not in keys:
        raise TensorParallelError(f"the checkpoint has no tensor for {name!r}.")
    return reader.read_whole(keys[name]).to(tp.device)


def load_shards(model: nn.Module, reader: CheckpointReader, keys: dict[str, str],
                tp: RankGroup, skip: frozenset[str] = frozenset()) -> None:
    """Read every parameter's slice (or whole replicated tensor) onto this rank's device;
    parameters named in `skip` (held by another pipeline stage) are not read. With one rank
    per tensor-parallel group (a pipeline stage without tp_size) every tensor is read whole,
    so families without a tensor-parallel plan load too."""
    plan = plan_model(model, find_policy(model), tp) if tp.size > 1 else None
    specs = {} if plan is None else plan.params
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = []
    for names in aliases.values():
        if skip.intersection(names):
            continue
        key = next((keys[n] for n in names if n in keys), None)
        if key is None:
            missing += names
            continue
        dtype = model.get_parameter(names[0]).dtype
        spec = next((specs[n] for n in names if n in specs), None)
        tensor = reader.read(key, spec).to(device=tp.device, dtype=dtype)
        set_parameter(model, names[0], tensor)
        shared = model.get_parameter(names[0])
        for other in names[1:]:  # tied weights stay one parameter
            owner, _, attr = other.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = shared
    if missing:
        raise TensorParallelError(
            f"the checkpoint has no tensor for {missing[:8]}{' ...' if len(missing) > 8 else ''}. "
            "Fix: use a checkpoint saved by save_pretrained for this architecture, or tp_size=1.")
    _load_buffers(model, reader, keys, tp.device)
    if plan is not None:
        state.put(model, "tp_plan", plan)


def _load_buffers(model: nn.Module, reader: CheckpointReader, keys: dict[str, str],
                  device: torch.device) -> None:
    for name, buffer in model.named_buffers():
        key = keys.get(name)
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        value = reader.read(key, None).to(buffer.dtype) if key else buffer
        module._buffers[attr] = value.to(device)


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
