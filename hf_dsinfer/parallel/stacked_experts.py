"""Per-stage reads of MoE checkpoints that store one tensor per expert.

transformers 5 keeps a MoE layer's experts as stacked 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]) but the MoE families' checkpoints store each expert's
projections apart (`experts.<e>.w1.weight` ...) and stack them while loading, so those tensors
have no key to read as a slice. `stacked_keys` maps each stacked parameter to a key of its own
that `StackedExpertReader` serves by stacking the experts' tensors (through the same
safetensors reads as every other tensor): a pipeline stage then reads only its own layers'
experts instead of loading the whole model.
"""

from __future__ import annotations

import torch

from hf_dsinfer.hf.checkpoint import stacked_expert_sources
from hf_dsinfer.parallel.expert import ExpertPlacement
from hf_dsinfer.parallel.loading import CheckpointReader
from hf_dsinfer.parallel.slicing import ShardSpec

STACKED = "stacked-experts:"  # prefix of the keys this reader makes up


class StackedExpertReader:
    """A CheckpointReader that also reads `STACKED + <parameter name>` keys: the experts'
    tensors of each source pattern stacked along a new dim 0, the patterns concatenated along
    dim 1 (gate | up), then sliced by the spec like any other tensor."""

    def __init__(self, reader: CheckpointReader, stacked: dict[str, list[list[str]]]):
        self.reader, self.stacked = reader, stacked
        self.files = reader.files
        self.share: tuple[int, int] | None = None  # (ep_size, ep rank): see keep_share
        self.reads = [0, 0]  # per-expert tensors read by `read`, and those it could have read

    def keep_share(self, ep_size: int, ep_rank: int) -> None:
        """From now on `read` fills only this expert-parallel rank's experts (parallel.expert's
        placement) of a stacked tensor: the other experts' rows stay unwritten - never touched,
        so never resident - until expert parallelism keeps this rank's rows. `read_whole` (the
        parity gate's references) still stacks every expert."""
        self.share = (ep_size, ep_rank)

    def __contains__(self, key: str) -> bool:
        return key in self.reader or key.removeprefix(STACKED) in self.stacked

    def read(self, key: str, spec: ShardSpec | None) -> torch.Tensor:
        if not key.startswith(STACKED):
            return self.reader.read(key, spec)
        patterns = self.stacked[key.removeprefix(STACKED)]
        self.reads[1] += sum(len(keys) for keys in patterns)
        if self.share is not None and spec is None:
            return self._read_share(patterns)
        self.reads[0] += sum(len(keys) for keys in patterns)
        whole = self.read_whole(key)
        return whole if spec is None else spec.take(whole)

    def _read_share(self, patterns: list[list[str]]) -> torch.Tensor:
        experts = ExpertPlacement(len(patterns[0]), *self.share).local_experts()
        out = None
        for e in experts:  # each expert copied in as it is read: one expert's tensors extra
            parts = [self.reader.read(keys[e], None) for keys in patterns]  # [I, H] each
            if out is None:  # [E, 2I, H]: only this rank's rows are ever written
                out = torch.empty(len(patterns[0]), sum(p.shape[0] for p in parts),
                                  *parts[0].shape[1:], dtype=parts[0].dtype)
            torch.cat(parts, dim=0, out=out[e])
        self.reads[0] += len(experts) * len(patterns)
        return out

    def read_whole(self, key: str) -> torch.Tensor:
        if not key.startswith(STACKED):
            return self.reader.read_whole(key)
        patterns = self.stacked[key.removeprefix(STACKED)]
        parts = [torch.stack([self.reader.read(k, None) for k in keys]) for keys in patterns]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [E, ...]


def stacked_keys(model: torch.nn.Module, reader: CheckpointReader
                 ) -> tuple[dict[str, str], StackedExpertReader] | None:
    """(model tensor name -> key, the reader serving those keys), or None when the checkpoint
    needs a conversion other than stacking experts."""
    found = stacked_expert_sources(model, reader.files)
    if found is None:
        return None
    plain, stacked = found
    keys = {**plain, **{name: STACKED + name for name in stacked}}
    return keys, StackedExpertReader(reader, stacked)


__all__ = ["StackedExpertReader", "stacked_keys"]
