"""Attach an OffloadPolicy to an HF model, and take it off again.

`attach_offload(model, policy)` works on a model whose decoder-layer weights are either in memory
(`init_inference` on a loaded model) or still in the checkpoint behind accelerate's disk-offload
hooks (`from_pretrained(..., dsinfer={"offload": ...})`, where `loading_device_map` marked every
decoder layer "disk", so transformers never materialised them). Steps, all before generation:

1. find the decoder layers, place every parameter on a tier, check the memory budget;
2. check the offload folder and write (or validate and reuse) the disk tier, layer by layer,
   reading each tensor from memory or straight from the checkpoint's safetensors;
3. replace accelerate's hooks by ours: each layer's forward becomes an `OffloadedLayer`,
   `model.generate` runs the block schedule, `model.hf_device_map` says where each module lives.
"""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import torch
from accelerate.hooks import remove_hook_from_module
from torch import nn

from hf_dsinfer import state
from hf_dsinfer.errors import DSInferError
from hf_dsinfer.injection.layers import decoder_layers
from hf_dsinfer.kernels.quant import Int4Weight
from hf_dsinfer.offload import files
from hf_dsinfer.offload.memory import ModelShape, check_budget, footprint
from hf_dsinfer.offload.packed import swap_in_packed
from hf_dsinfer.offload.policy import OffloadPolicy
from hf_dsinfer.offload.schedule import OffloadedLayer, OffloadEngine
from hf_dsinfer.offload.store import WeightStore, fingerprint, place_layer


def compute_device(policy: OffloadPolicy) -> torch.device:
    device = torch.device(policy.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DSInferError(
            f"hf_dsinfer offload: device={policy.device!r} but this torch has no CUDA device. "
            "Fix: leave device out (the CPU is then the compute device).")
    if device.type == "cuda" and policy.cpu_attention:
        # CPU delegation of attention needs an attention path that runs where the cache is;
        # it is not built yet, and a flag that silently does nothing is worse than an error.
        raise DSInferError(
            "hf_dsinfer offload: cpu_attention=True on a CUDA compute device is not supported "
            "yet. Fix: cpu_attention=False (attention runs on the GPU; a CPU-resident cache is "
            "copied in by the prefetch thread).")
    return device



def get_engine(model: nn.Module) -> OffloadEngine | None:
    return state.get(model, "engine")


# -- placement for from_pretrained -----------------------------------------------------------------
def loading_device_map(model: nn.Module, policy: OffloadPolicy) -> dict[str, str | int]:
    """The device map transformers loads with: decoder layers stay in the checkpoint ("disk"),
    everything else goes to the compute device. The store is built from there."""
    prefix, blocks = decoder_layers(model)
    device = _map_device(compute_device(policy))
    device_map = {f"{prefix}.{i}": "disk" for i in range(len(blocks))}
    for name, _ in model.named_children():
        _fill(model, name, prefix, device, device_map)
    return device_map


def _fill(model: nn.Module, path: str, prefix: str, device, device_map: dict) -> None:
    """Map every module outside the layer list to `device`, descending only into its ancestors."""
    if path == prefix:
        return
    if not prefix.startswith(path + "."):
        device_map[path] = device
        return
    for child, _ in model.get_submodule(path).named_children():
        _fill(model, f"{path}.{child}", prefix, device, device_map)


def _map_device(device: torch.device) -> str | int:
    return "cpu" if device.type == "cpu" else (device.index or 0)


# -- attach / detach -------------------------------------------------------------------------------
def attach_offload(model: nn.Module, policy: OffloadPolicy) -> OffloadEngine:
    """Offload `model`'s decoder layers per `policy` (see the module docstring)."""
    if get_engine(model) is not None:
        detach_offload(model)
    prefix, blocks = decoder_layers(model)
    device = compute_device(policy)
    dtype = next(blocks[0].parameters()).dtype
    slots = place_layer(blocks[0], policy, dtype, device)
    _check_same_layers(blocks, slots)
    store = WeightStore(slots, len(blocks), policy, device)
    shape = ModelShape.from_model(model, list(blocks), dtype)
    per_use = sum(s.buffer_nbytes for s in slots if not s.bound)
    check_budget(footprint(shape, policy, device.type == "cuda", policy.block_size, 0, 0,
                           per_use), policy, "holding the weights (before any token)",
                 "raise the budget, or move weights to disk (weights=(0, x, 100 - x)), turn on "
                 "compress_weights, or turn off overlap (one layer in flight instead of two).")
    source, source_id = _weight_source(blocks)
    folder = _disk_folder(policy, model, slots, len(blocks), source_id)
    remove_hook_from_module(model, recurse=True)  # accelerate's per-module loading hooks
    _swap_packed(blocks, slots, policy.group_size)
    bind = functools.partial(_bind, blocks)
    build = functools.partial(store.build, source, folder, folder.name if folder else "", bind)
    if policy.parallel_fetch:  # ZeRO-Inference: each rank reads 1/N of every layer file
        from hf_dsinfer.parallel.fetch import ParallelFetch

        _check_parallel_fetch(policy, store)
        store.fetch = ParallelFetch()
        store.fetch.build_in_turn(build)
    else:
        build()
    del source  # holds every in-memory block parameter until here
    _move_others(model, prefix, device)
    engine = OffloadEngine(list(blocks), store, policy, device, shape)
    _install(model, blocks, engine)  # drops the dense originals of the streamed weights
    _return_freed_memory()
    model.hf_device_map = _device_map(model, prefix, blocks, slots, device)
    return engine


def _check_parallel_fetch(policy: OffloadPolicy, store: WeightStore) -> None:
    if not store.whole_file or not any(s.tier == "disk" for s in store.slots):
        raise DSInferError(
            f"hf_dsinfer offload: parallel_fetch=True splits the reads of the disk tier's layer "
            f"files on a CPU compute device; got weights={policy.weights} on "
            f"{store.device}. Fix: put weights on disk (weights=(0, x, 100 - x)) with a CPU "
            "compute device, or drop parallel_fetch.")


def detach_offload(model: nn.Module) -> nn.Module:
    """Undo attach_offload: every layer gets its weights back in memory (dense, on the compute
    device) and its previous forward. Needs memory for the whole model."""
    engine = get_engine(model)
    if engine is None:
        return model
    for j, block in enumerate(engine.blocks):
        layer = block.__dict__.get("forward")
        for name, tensor in engine.store.load(j).items():
            _bind(engine.blocks, j, name, tensor)
        if isinstance(layer, OffloadedLayer):
            if getattr(layer.inner, "__self__", None) is block:
                del block.forward  # the class forward again
            else:
                block.forward = layer.inner
    engine.close()
    state.put(model, "engine", None)
    return model


def _check_same_layers(blocks: nn.ModuleList, slots) -> None:
    expected = [(s.name, s.shape) for s in slots]
    for j, block in enumerate(blocks):
        got = [(n, tuple(p.shape)) for n, p in block.named_parameters()]
        if got != expected:
            raise DSInferError(
                f"hf_dsinfer offload: decoder layer {j} has different parameters from layer 0; "
                "the FlexGen placement splits every layer the same way. Fix: offload models "
                "whose decoder layers are all alike.")


def _weight_source(blocks: nn.ModuleList):
    """(source(j, name) -> CPU tensor, identity of where the weights come from). Where a
    parameter is still on meta, accelerate's hook knows its place in the checkpoint: that is
    captured here, before the hooks are removed."""
    where: dict[tuple[int, str], tuple] = {}
    for j, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if param.device.type == "meta":
                path, _, attr = name.rpartition(".")
                module = block.get_submodule(path) if path else block
                where[(j, name)] = _hook_location(module, attr)
    # in-memory parameters, by reference (their modules may be swapped before they are read)
    resident = {(j, name): param for j, block in enumerate(blocks)
                for name, param in block.named_parameters() if (j, name) not in where}
    readers: dict[str, files.SafetensorsFile] = {}

    def source(j: int, name: str) -> torch.Tensor:
        if (j, name) not in where:
            return resident[(j, name)].detach()
        weights_map, full, entry = where[(j, name)]
        if "safetensors_file" not in entry:
            return weights_map[full.removeprefix(weights_map.prefix)]  # accelerate's .dat files
        path = entry["safetensors_file"]
        if path not in readers:
            readers[path] = files.SafetensorsFile(Path(path))
        return readers[path].read(entry["weight_name"])

    checkpoint = sorted({e["safetensors_file"] for _, _, e in where.values()
                         if "safetensors_file" in e})
    if where and checkpoint:
        identity = [(p, Path(p).stat().st_size, Path(p).stat().st_mtime_ns) for p in checkpoint]
        return source, repr(identity)
    return source, f"memory:{uuid.uuid4().hex}"  # weights in RAM: never reuse a disk tier


def _hook_location(module: nn.Module, attr: str):
    weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights_map is None:
        raise DSInferError(
            f"hf_dsinfer offload: parameter {attr!r} of {type(module).__name__} is on the meta "
            "device and no loader knows where it is. Fix: load the model with "
            "from_pretrained(..., dsinfer={'offload': ...}) or with its weights in memory.")
    full = weights_map.prefix + attr
    return weights_map, full, weights_map.dataset.index.get(full, {})


def _disk_folder(policy: OffloadPolicy, model: nn.Module, slots, num_layers: int,
                 source_id: str) -> Path | None:
    if not any(s.tier == "disk" for s in slots):
        return None
    root = Path(policy.offload_dir)
    files.check_writable(root)
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    config.pop("quantization_config", None)
    fp = fingerprint(config, slots, num_layers, policy, source_id)
    return root / "weights" / fp[:20]


def _bind(blocks: nn.ModuleList, j: int, name: str, tensor: torch.Tensor | Int4Weight) -> None:
    path, _, attr = name.rpartition(".")
    module = blocks[j].get_submodule(path) if path else blocks[j]
    if isinstance(tensor, Int4Weight):
        module.bind(tensor)
    else:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _swap_packed(blocks: nn.ModuleList, slots, group_size: int) -> None:
    """Packed 4-bit slots: their nn.Linear becomes a PackedInt4Linear, and a fused block
    re-resolves its submodules."""
    names = [s.name for s in slots if s.packed]
    if not names:
        return
    for block in blocks:
        swap_in_packed(block, names, group_size)
        fused = block.__dict__.get("forward")
        if hasattr(fused, "bind") and hasattr(fused, "linear_slots"):  # a FusedBlock
            fused.bind()


def _return_freed_memory() -> None:
    """Give the heap pages freed while building the store back to the OS. Building reads and
    converts every tensor once; glibc keeps freed chunks below its (dynamic, up to 32 MB) mmap
    threshold in the heap, which held RSS far above the budget (docs/performance.md, "Behind the code")."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


def _move_others(model: nn.Module, prefix: str, device: torch.device) -> None:
    """Everything outside the decoder layers lives on the compute device."""
    for path, module in model.named_modules():
        if path == prefix or path.startswith(prefix + "."):
            continue
        for name, param in list(module._parameters.items()):
            if param is not None and param.device != device:
                module._parameters[name] = nn.Parameter(param.to(device), requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _install(model: nn.Module, blocks: nn.ModuleList, engine: OffloadEngine) -> None:
    for j, block in enumerate(blocks):
        inner = block.__dict__.get("forward", block.forward)
        block.forward = OffloadedLayer(engine, j, block, inner)
        engine.release(j)  # per-use weights leave memory until their layer runs
    state.put(model, "engine", engine)  # hf_dsinfer.phases installs offload_generate


def _device_map(model: nn.Module, prefix: str, blocks: nn.ModuleList, slots,
                device: torch.device) -> dict[str, str | int]:
    """accelerate's vocabulary: each leaf module -> the tier holding most of its bytes."""
    names = {"device": _map_device(device), "cpu": "cpu", "disk": "disk"}
    tiers: dict[str, dict[str, int]] = {}
    for slot in slots:
        owner = slot.name.rpartition(".")[0]
        tiers.setdefault(owner, {}).setdefault(slot.tier, 0)
        tiers[owner][slot.tier] += slot.dense_nbytes
    device_map = {}
    for path, _ in model.named_children():
        _fill(model, path, prefix, names["device"], device_map)
    for j in range(len(blocks)):
        for owner, by_tier in tiers.items():
            key = f"{prefix}.{j}.{owner}" if owner else f"{prefix}.{j}"
            device_map[key] = names[max(by_tier, key=by_tier.get)]
    return device_map
