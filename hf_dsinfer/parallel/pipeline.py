"""Pipeline parallelism for inference (DeepSpeed-Inference §IV-B/C): stages, their wiring, the
lock-step forward.

`pp_size=P` cuts the decoder layers into P contiguous stages balanced by bytes (`plan_stages`);
stage k runs on the w = tp * ep ranks [k*w, (k+1)*w) (each stage may itself be tensor-parallel,
and shard its MoE layers' experts over its ranks). A rank keeps:
- the blocks of its stage; every other block is replaced in the model's layer list by a
  `StageBoundary`, a parameter-free placeholder that passes the hidden state through, so the
  HF model's own forward (embeddings, rotary tables, masks per layer type, final norm) runs
  unchanged on every stage;
- the token embedding on the first stage only (elsewhere it returns zeros of the right shape:
  nothing before the first layer is used on later stages), the untied lm_head on the last
  stage only (a tied one on the first and last); the small modules outside the layers (final
  norm, position embeddings, embedding norms) on every stage;
- the KV cache of its own layers: a `DynamicCache` whose other layers stay empty, with its
  length queries redirected to one of the stage's own layers (`bind_stage_cache`) - HF's own
  pp_size reads the length of layer 0, which later stages never write, and so builds wrong
  masks for left-padded batches.

On stage k > 0 the placeholder just before the stage's first block (the *entry*) returns the
hidden state received from stage k-1; on stage k < P-1 the placeholder just after its last
block (the *exit*) stops the forward (`StageExit`) with that block's output, which is sent on.

A plain `model(...)` / `model.base_model(...)` call runs every stage in turn (lock-step, one
micro-batch: for logits, the parity gate, tests); every rank must make the same call, and every
rank gets the last stage's output (broadcast). `model.generate` runs the micro-batched schedule
of parallel/pipeline_generate.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import itertools
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from hf_dsinfer import state
from hf_dsinfer.errors import ParityError, PipelineParallelError, StageExit
from hf_dsinfer.hf import cache_args
from hf_dsinfer.injection.layers import layers_path
from hf_dsinfer.injection.parity import run_parity_gate
from hf_dsinfer.injection.policy import Policy
from hf_dsinfer.injection.walker import InjectionReport, drop_blocks
from hf_dsinfer.parallel.groups import RankGroup, ensure_world, rank_group

STUB_ATTR = "_dsinfer_pipeline_stub"  # on embedding / head modules whose weights live elsewhere
_COPIED_ATTRS = ("attention_type", "layer_type", "layer_idx", "is_sliding", "sliding_window")


# -- planning ------------------------------------------------------------------------------------
def partition(costs: list[int], stages: int, first_extra: int = 0,
              last_extra: int = 0) -> list[range]:
    """Contiguous, non-empty ranges of `costs` (one per stage) minimising the largest stage's
    cost, the first stage also paying `first_extra` (the embedding) and the last `last_extra`
    (lm_head). Exact dynamic programme over split points: O(stages * n^2)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise PipelineParallelError(
            f"pp_size={stages}: a pipeline needs at least one decoder layer per stage, the model "
            f"has {n}. Fix: use pp_size <= {n}.")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-stage cost of putting layers [0, i) on stages 0..s
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = prefix[i] + first_extra
    for s in range(1, stages):
        extra = last_extra if s == stages - 1 else 0
        for i in range(s + 1, n + 1):
            for j in range(s, i):  # stage s holds [j, i)
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [n], n
    for s in range(stages - 1, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which layers each stage holds and the bytes it is planned to load."""

    layers: tuple[range, ...]
    stage_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    tied: bool
    # per-expert checkpoint tensors this rank read for its stage, of those its layers have
    # (loaded sharded from a per-expert MoE checkpoint; fewer under ep_size: its share)
    expert_reads: tuple[int, int] | None = None

    def stage_of(self, layer: int) -> int:
        return next(s for s, r in enumerate(self.layers) if layer in r)


def plan_stages(model: nn.Module, blocks: list[nn.Module], pp: int) -> StagePlan:
    """Balance the blocks over `pp` stages by their weight bytes (real or meta weights)."""
    costs = [_bytes(b.parameters()) for b in blocks]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    embed_bytes = _bytes(embed.parameters())
    head_bytes = 0 if head is None else _bytes(head.parameters())
    layers = partition(costs, pp, embed_bytes, head_bytes)
    stage_bytes = [sum(costs[i] for i in r) for r in layers]
    stage_bytes[0] += embed_bytes
    stage_bytes[-1] += head_bytes
    return StagePlan(tuple(layers), tuple(stage_bytes), embed_bytes, head_bytes, tied)


# -- groups --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineRanks:
    """This rank's place in the pipeline: its stage, neighbours and pipeline group.

    A stage is `width` = tp_size * ep_size consecutive ranks (its lanes); lane j of every stage
    forms one pipeline that passes messages along, and the lanes of a stage run the same
    schedule on the same tokens (their tensor- and expert-parallel collectives stay inside the
    stage)."""

    stage: int
    size: int
    prev: int | None     # global rank of the same lane on stage - 1
    next: int | None     # ... on stage + 1
    first: int           # ... on stage 0 (where the last stage sends generated tokens)
    last: int            # ... on the last stage
    group: RankGroup     # the ranks of this rank's lane, one per stage
    timeout: datetime.timedelta
    width: int = 1       # ranks per stage (tp_size * ep_size)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1


NCCL_WHY = (
    "pp_size={pp}: the pipeline runs on gloo process groups only, and this one uses the "
    "{backend!r} backend. Why: the stages exchange CPU tensors by gloo point-to-point messages; "
    "passing GPU tensors between stages over NCCL is not built, because this project has had no "
    "GPU to verify it on, and an unverified schedule could hang or return wrong tokens. What "
    "works instead: the pipeline on CPU processes (init_process_group('gloo'), which torchrun "
    "picks on a machine without CUDA), alone or with tp_size / ep_size inside each stage; on "
    "GPUs, tp_size / ep_size without pp_size.")


def pipeline_ranks(pp: int, tp: int, timeout_s: float, ep: int = 1) -> PipelineRanks:
    """Stage k is ranks [k*w, (k+1)*w) with w = tp * ep (tensor-parallel groups consecutive,
    expert-parallel groups strided by tp inside the stage, as without a pipeline)."""
    world, width = ensure_world(f"pp_size={pp}"), tp * ep
    if world != pp * width:
        raise PipelineParallelError(
            f"pp_size={pp} with tp_size={tp} and ep_size={ep} needs exactly {pp * width} "
            f"processes (tp_size * ep_size * pp_size), got a world of {world}. Fix: launch "
            f"`torchrun --nproc-per-node {pp * width}`, or choose tp_size * ep_size * pp_size "
            f"= {world}.")
    if dist.get_backend() != "gloo":
        raise PipelineParallelError(NCCL_WHY.format(pp=pp, backend=dist.get_backend()))
    rank = dist.get_rank()
    stage, index = divmod(rank, width)
    group = rank_group(pp, width, f"pp_size={pp}")
    return PipelineRanks(
        stage, pp, rank - width if stage else None, rank + width if stage < pp - 1 else None,
        index, (pp - 1) * width + index, group, datetime.timedelta(seconds=timeout_s), width)


# -- point-to-point tensors ----------------------------------------------------------------------
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64]
_HEADER = 8  # [ndim, dtype code, up to 6 dims]


def _header(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > _HEADER - 2:
        raise PipelineParallelError(f"cannot send a {x.dim()}-d tensor between stages")
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0], head[1] = x.dim(), _DTYPES.index(x.dtype)
    head[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    return head


def _empty(head: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim, code = int(head[0]), int(head[1])
    return torch.empty([int(d) for d in head[2:2 + ndim]], dtype=_DTYPES[code], device=device)


@contextlib.contextmanager
def peer_errors(ranks: PipelineRanks, peer: int, what: str) -> Iterator[None]:
    """Turn gloo's errors talking to `peer` (a timeout, a closed connection) into
    PipelineParallelError: that rank failed, hung or exited."""
    try:
        yield
    except RuntimeError as err:
        raise PipelineParallelError(
            f"pipeline stage {ranks.stage} (rank {dist.get_rank()}): {what} rank {peer} failed "
            f"within pp_timeout_s={ranks.timeout.total_seconds():g}: that rank failed, hung or "
            f"exited (gloo: {err}). Fix: see that rank's error; raise pp_timeout_s if its stage "
            "is just slow. The process group is unusable now.") from err


def wait_recv(work: Any, ranks: PipelineRanks, src: int, what: str) -> None:
    """Wait for a posted receive; a silent neighbour becomes PipelineParallelError."""
    with peer_errors(ranks, src, f"receiving {what} from"):
        work.wait(timeout=ranks.timeout)


def send_tensor(x: torch.Tensor, dst: int) -> list:
    """Post a shape header and the tensor to `dst`; returns the works and buffers to keep alive
    until they complete."""
    x = x.contiguous()
    head = _header(x)
    return [(dist.isend(head, dst), head), (dist.isend(x, dst), x)]


def recv_tensor(src: int, ranks: PipelineRanks, device: torch.device, what: str) -> torch.Tensor:
    head = torch.empty(_HEADER, dtype=torch.int64)
    wait_recv(dist.irecv(head, src), ranks, src, what)
    out = _empty(head, device)
    wait_recv(dist.irecv(out, src), ranks, src, what)
    return out


# One generate message = a fixed header + one byte payload holding up to three tensors: two
# gloo messages per item (each message costs a rendezvous with the receiver).
MESSAGE_HEADER = 32  # [kind, micro-batch, step, origin, count, nbytes, 3 x (dtype, ndim, 4 dims)]


def pack(fields: tuple[int, int, int, int], tensors: tuple[torch.Tensor, ...]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a message: `fields` = (kind, micro-batch, step, origin rank)."""
    head = torch.zeros(MESSAGE_HEADER, dtype=torch.int64)
    head[:4] = torch.tensor(fields)
    head[4] = len(tensors)
    parts = []
    for i, x in enumerate(tensors):
        x = x.detach().contiguous().cpu()
        if x.dim() > 4 or i > 2:
            raise PipelineParallelError(f"cannot pack {len(tensors)} tensors / a {x.dim()}-d one")
        at = 6 + 6 * i
        head[at], head[at + 1] = _DTYPES.index(x.dtype), x.dim()
        head[at + 2:at + 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        parts.append(x.reshape(-1).view(torch.uint8))
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    head[5] = payload.numel()
    return head, payload


def unpack(head: torch.Tensor, payload: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for i in range(int(head[4])):
        at = 6 + 6 * i
        dtype, ndim = _DTYPES[int(head[at])], int(head[at + 1])
        shape = [int(d) for d in head[at + 2:at + 2 + ndim]]
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(payload[offset:offset + nbytes].view(dtype).view(shape).clone())
        offset += nbytes
    return out


def broadcast_from_last(x: torch.Tensor | None, ranks: PipelineRanks,
                        device: torch.device) -> torch.Tensor:
    """The last stage's `x` on every stage of this rank's pipeline group."""
    head = _header(x) if x is not None else torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(head, src=ranks.last, group=ranks.group.group)
    out = x.contiguous() if x is not None else _empty(head, device)
    dist.broadcast(out, src=ranks.last, group=ranks.group.group)
    return out


def finish_sends(pending: list, ranks: PipelineRanks, dst: int) -> None:
    """Wait (at most pp_timeout_s each) until posted sends to `dst` have been received."""
    with peer_errors(ranks, dst, "sending to"):
        for work, _ in pending:
            work.wait(timeout=ranks.timeout)
    pending.clear()


# -- the per-stage model -------------------------------------------------------------------------
class StageBoundary(nn.Module):
    """Stands in the layer list for a block held by another stage: no parameters, passes the
    hidden state through (in the block's output format). The entry placeholder (just before
    this stage's first block) returns the hidden state received from the previous stage; the
    exit placeholder (just after its last block) stops the forward with its input."""

    is_pipeline_placeholder = True

    def __init__(self, index: int, stage: int, role: str | None, returns_tuple: bool,
                 block: nn.Module, runner: StageRunner):
        super().__init__()
        self.index, self.stage, self.role = index, stage, role
        self.returns_tuple = returns_tuple
        self.skip_reason = f"held by pipeline stage {stage}"
        self.__dict__["runner"] = runner  # not a submodule
        for attr in _COPIED_ATTRS:
            if attr in block.__dict__:
                setattr(self, attr, block.__dict__[attr])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.role == "exit":
            raise StageExit(hidden)
        if self.role == "entry":
            hidden = self.runner.take_incoming()
        return (hidden, None) if self.returns_tuple else hidden

    def extra_repr(self) -> str:
        return f"layer {self.index}, {self.skip_reason}" + (f", {self.role}" if self.role else "")


class ZeroEmbedding:
    """Installed as the token embedding's `forward` on stages > 0: its table is on stage 0, and
    what the layers before this stage's entry compute is replaced by the received state."""

    def __init__(self, width: int, dtype: torch.dtype):
        self.width, self.dtype = width, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)


class RemoteHead:
    """Installed as lm_head's `forward` on stages before the last: the last stage's logits."""

    def __init__(self, runner: StageRunner):
        self.runner = runner

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return broadcast_from_last(None, self.runner.ranks, hidden.device)


class StageRunner:
    """Runs this rank's stage of one forward: feeds the entry placeholder, catches the exit."""

    def __init__(self, ranks: PipelineRanks, plan: StagePlan, policy: Policy):
        self.ranks, self.plan, self.policy = ranks, plan, policy
        self.layers = plan.layers[ranks.stage]
        self.incoming: torch.Tensor | None = None
        self.looping = False  # inside the generate schedule: no lock-step messages

    def take_incoming(self) -> torch.Tensor:
        if self.incoming is None:
            raise PipelineParallelError(
                f"pipeline stage {self.ranks.stage} was run without the hidden state of stage "
                f"{self.ranks.stage - 1}. Fix: call the model on every rank at once.")
        hidden, self.incoming = self.incoming, None
        return hidden

    def run(self, forward: Any, kwargs: dict[str, Any], incoming: torch.Tensor | None) -> Any:
        """(stage output, None) on the last stage; (None, hidden to send on) on the others."""
        self.incoming = incoming
        try:
            return forward(**kwargs), None
        except StageExit as done:
            return None, done.hidden
        finally:
            self.incoming = None


def bind_stage_cache(cache: Cache, layers: range) -> None:
    """Redirect `cache`'s length queries to this stage's own layers (in place, idempotent).

    HF asks the cache for its length at layer 0 (positions) and, for the masks, at the first
    full-attention / first sliding layer; on a later stage those layers are never written. Each
    query goes to the stage's first own layer of the same kind (sliding or not) instead."""
    if getattr(cache, "_dsinfer_stage_layers", None) == layers:
        return
    cache._dsinfer_stage_layers = layers
    cache.get_seq_length = _SeqLength(cache, layers)
    cache.get_mask_sizes = _MaskSizes(cache, layers)


def _own_layer(cache: Cache, layers: range, layer_idx: int) -> int:
    if layer_idx in layers or layer_idx >= len(cache.layers):
        return layer_idx
    sliding = getattr(cache.layers[layer_idx], "is_sliding", False)
    same = [i for i in layers if i < len(cache.layers)
            and getattr(cache.layers[i], "is_sliding", False) == sliding]
    return same[0] if same else layers[0]


class _SeqLength:
    """Installed as a stage cache's `get_seq_length`."""

    def __init__(self, cache: Cache, layers: range):
        self.cache, self.layers = cache, layers

    def __call__(self, layer_idx: int = 0) -> int:
        own = _own_layer(self.cache, self.layers, layer_idx)
        return type(self.cache).get_seq_length(self.cache, own)


class _MaskSizes:
    """Installed as a stage cache's `get_mask_sizes`."""

    def __init__(self, cache: Cache, layers: range):
        self.cache, self.layers = cache, layers

    def __call__(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        own = _own_layer(self.cache, self.layers, layer_idx)
        return type(self.cache).get_mask_sizes(self.cache, query_length, own)


class PipelinedBaseForward:
    """Installed as the `forward` of the module that loops over the layers (the base model, or
    OPT's decoder): one lock-step pass through every stage.

    Every rank calls the model with the same arguments; stage k waits for stage k-1's hidden
    state, runs its blocks and sends on; the last stage's final hidden state is broadcast so
    every rank returns the same output. Inside the generate schedule it is the plain forward."""

    def __init__(self, base: nn.Module, runner: StageRunner):
        self.forward = type(base).forward.__get__(base)
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.runner.looping:
            return self.forward(*args, **kwargs)
        kwargs = _by_name(self.forward, args, kwargs)  # GPT-2's head passes input_ids by position
        ranks = self.runner.ranks
        cache = cache_args.model_cache(kwargs)
        if isinstance(cache, Cache):
            bind_stage_cache(cache, self.runner.layers)
        device = _device_of(kwargs)
        incoming = None if ranks.is_first else recv_tensor(ranks.prev, ranks, device,
                                                           "a hidden state")
        out, hidden = self.runner.run(self.forward, kwargs, incoming)
        if hidden is not None:
            with peer_errors(ranks, ranks.next, "sending a hidden state to"):
                sent = send_tensor(hidden, ranks.next)
            finish_sends(sent, ranks, ranks.next)
        last = broadcast_from_last(None if out is None else _first(out), ranks, device)
        if out is None:
            out = StageOutput(last_hidden_state=last, **{cache_args.KEYWORD: cache})
            return out if kwargs.get("return_dict", True) is not False else out.to_tuple()
        return out


class StageOutput(BaseModelOutputWithPastAndCrossAttentions):
    """The base model's output on a stage before the last: the last stage's final hidden state.
    Fields a family's own output class adds (MoE router logits, ...) read as None, as they do
    when not asked for."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _by_name(forward: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not args:
        return kwargs
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise PipelineParallelError(
                f"{type(forward.__self__).__name__}.forward got extra positional arguments "
                "under pipeline parallelism. Fix: pass them by name.")
        named.update(value) if kind is inspect.Parameter.VAR_KEYWORD else \
            named.__setitem__(name, value)
    return named


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _device_of(kwargs: dict[str, Any]) -> torch.device:
    for key in ("input_ids", "inputs_embeds", "attention_mask"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key].device
    return torch.device("cpu")


def _broadcast_logits(runner: StageRunner) -> Any:
    def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        if runner.looping:
            return output
        return broadcast_from_last(output, runner.ranks, output.device)
    return hook


class RefusedUnderPipeline:
    """Installed as a model method that cannot work on one pipeline stage (save_pretrained:
    the rank holds one stage's weights; HF's continuous batching: each rank's scheduler
    thread would pick its own batches, and the stages would wait on each other forever)."""

    FIXES: ClassVar[dict[str, str]] = {
        "save_pretrained": "save from a pp_size=1 model; from_pretrained(..., dsinfer="
                           "{'pp_size': N}) then reads each stage's weights from that checkpoint",
        "generate_batch": "call model.generate(...) with the batch on every rank",
        "init_continuous_batching": "call model.generate(...) with the batch on every rank",
    }

    def __init__(self, name: str, stage: int):
        self.name, self.stage = name, stage

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineParallelError(
            f"{self.name} on a pipeline-parallel model (this rank is stage {self.stage}) is not "
            f"supported. Fix: {self.FIXES[self.name]}.")


# -- turning a model into one stage --------------------------------------------------------------
def micro_batch_counts(config: Any) -> tuple[int, int]:
    """(generation, prompt) micro-batch counts before capping by the batch size."""
    mb = config.pp_micro_batches or config.pp_size
    return mb, config.pp_prompt_micro_batches or 2 * mb


def layer_list(model: nn.Module, policy: Policy) -> tuple[str, nn.ModuleList]:
    path = layers_path(model, policy)
    if path is None:
        raise PipelineParallelError(
            f"pp_size: no decoder layers found in {type(model).__name__}. Fix: use a supported "
            "family, or pp_size=1.")
    return path, model.get_submodule(path)


def place_boundaries(layers: nn.ModuleList, plan: StagePlan, stage: int, returns_tuple: bool,
                     runner: StageRunner) -> list[int]:
    """Replace the blocks of other stages by placeholders; returns the replaced indices."""
    own = plan.layers[stage]
    replaced = []
    for i in range(len(layers)):
        if i in own:
            continue
        role = "entry" if i == own.start - 1 else "exit" if i == own.stop else None
        layers[i] = StageBoundary(i, plan.stage_of(i), role, returns_tuple, layers[i], runner)
        replaced.append(i)
    return replaced


def stub_parameters(model: nn.Module, names: list[str]) -> None:
    """Give parameters this stage does not hold an empty CPU tensor of their dtype (not meta:
    HF reads a model's device and dtype from its first parameter, the embedding). Tied
    parameters stay one parameter."""
    done: dict[int, nn.Parameter] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for name in names:
        old = named[name]
        if id(old) not in done:
            done[id(old)] = nn.Parameter(torch.empty(0, dtype=old.dtype), requires_grad=False)
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = done[id(old)]


def unheld_parameters(model: nn.Module, plan: StagePlan, stage: int) -> list[str]:
    """Names of the embedding / lm_head parameters this stage does not load."""
    from hf_dsinfer.parallel.plan import module_name

    first, last = stage == 0, stage == len(plan.layers) - 1
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = []
    if not first and not (plan.tied and last):
        prefix = module_name(model, embed)
        names += [f"{prefix}.{n}" for n, _ in embed.named_parameters()]
    if head is not None and not last and not (plan.tied and first):
        prefix = module_name(model, head)
        names += [f"{prefix}.{n}" for n, _ in head.named_parameters()]
    return names


@dataclasses.dataclass
class PPReport:
    """What pipeline parallelism did on this rank; printed by explain."""

    ranks: PipelineRanks
    plan: StagePlan
    layers_path: str
    loaded_bytes: int
    loaded_sharded: bool
    micro_batches: int
    prompt_micro_batches: int
    runner: StageRunner  # the stage's messaging, driven by parallel.pipeline_generate

    def describe(self) -> str:
        stages = "; ".join(
            f"stage {s}: layers {r.start}-{r.stop - 1} ({b / 2**20:.2f} MiB planned"
            f"{', embedding' if s == 0 else ''}{', lm_head' if s == len(self.plan.layers) - 1 else ''})"
            for s, (r, b) in enumerate(zip(self.plan.layers, self.plan.stage_bytes)))
        how = "only this stage's weights read from the checkpoint" if self.loaded_sharded else \
            "split in place after the single-process parity gate"
        if self.plan.expert_reads is not None:
            how += (f" ({self.plan.expert_reads[0]} of the stage's {self.plan.expert_reads[1]} "
                    "per-expert tensors)")
        return (f"pipeline parallel: stage {self.ranks.stage} of {self.ranks.size} (global rank "
                f"{dist.get_rank()}), {how}; this rank holds {self.loaded_bytes / 2**20:.2f} MiB "
                f"of weights; {stages}; generate: {self.prompt_micro_batches} prompt / "
                f"{self.micro_batches} generation micro-batches (dynamic queue)")


def _stage_blocks(report: InjectionReport, plan: StagePlan, stage: int) -> set[str]:
    return {p for p in report.blocks if int(p.rsplit(".", 1)[1]) in plan.layers[stage]}


def _split_in_place(model: nn.Module, report: InjectionReport, runner: StageRunner) -> None:
    """A full model on every rank (init_inference): keep this stage, drop the rest."""
    _, layers = layer_list(model, report.policy)
    stage = runner.ranks.stage
    keep = _stage_blocks(report, runner.plan, stage)
    drop_blocks(report, [p for p in report.blocks if p not in keep])
    place_boundaries(layers, runner.plan, stage, report.policy.returns_tuple, runner)
    if report.config.tp_size > 1:  # slice this stage's weights now, while the vocab is whole
        from hf_dsinfer.parallel.groups import tensor_parallel_group
        from hf_dsinfer.parallel.tensor import plan_model, shard_in_place

        tp_plan = plan_model(model, report.policy, tensor_parallel_group(report.config.tp_size))
        shard_in_place(model, tp_plan)
        state.put(model, "tp_plan", tp_plan)
    stub_parameters(model, unheld_parameters(model, runner.plan, stage))


def pipeline_parallelize(model: nn.Module, report: InjectionReport) -> PPReport:
    """Wire an injected model as this rank's pipeline stage (walker, when pp_size > 1)."""
    cfg = report.config
    ranks = pipeline_ranks(cfg.pp_size, cfg.tp_size, cfg.pp_timeout_s, cfg.ep_size)
    plan = state.get(model, "pp_stages")  # the pipeline loader read only this stage
    loaded_sharded = plan is not None
    layers_path, layers = layer_list(model, report.policy)
    runner = StageRunner(ranks, plan or plan_stages(model, list(layers), ranks.size),
                         report.policy)
    if loaded_sharded:
        for module in layers:
            if isinstance(module, StageBoundary):
                module.__dict__["runner"] = runner
    else:
        _split_in_place(model, report, runner)
    _wire(model, runner)  # hf_dsinfer.phases installs the pipelined generate over the runner
    for name in RefusedUnderPipeline.FIXES:
        setattr(model, name, RefusedUnderPipeline(name, ranks.stage))
    mb, prompt = micro_batch_counts(cfg)
    return PPReport(ranks, runner.plan, layers_path, held_bytes(model), loaded_sharded, mb,
                    prompt, runner)


def held_bytes(model: nn.Module) -> int:
    """The weight bytes this rank holds (its stage, its slices, its experts)."""
    return _bytes(p for p in model.parameters() if p.device.type != "meta")


def _wire(model: nn.Module, runner: StageRunner) -> None:
    ranks = runner.ranks
    # the module that loops over the layers (the base model; OPT's decoder inside it)
    path, _ = layer_list(model, runner.policy)
    stack = model.get_submodule(path.rpartition(".")[0])
    stack.forward = PipelinedBaseForward(stack, runner)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not ranks.is_first and embed.weight.numel() == 0:
        embed.forward = ZeroEmbedding(embed.embedding_dim, embed.weight.dtype)
        setattr(embed, STUB_ATTR, True)
    if head is not None and not ranks.is_last:
        head.forward = RemoteHead(runner)
        setattr(head, STUB_ATTR, True)
    elif head is not None:
        head.register_forward_hook(_broadcast_logits(runner))


def stage_parity_gate(model: nn.Module, report: InjectionReport, refs: dict[str, Any]) -> None:
    """The parity gate of a stage loaded sharded (hf_dsinfer.phases runs it once the stage's
    tensor- and expert-parallel slices are in place): every rank raises, or none does."""
    report.parity = run_parity_gate(model, report.blocks, refs)
    failed = {name: r for name, r in report.parity.items() if not r.passed}
    verdict = torch.tensor(0 if failed else 1)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every stage raises, or none does
    if int(verdict) == 0 and not failed:
        raise ParityError("another pipeline stage's fused blocks failed their parity gate (see "
                          "that rank's error). Fix: load with pp_size=1.")
    if failed:
        detail = "; ".join(f"{name}: {r.summary()}" for name, r in failed.items())
        raise ParityError(
            f"pipeline-stage fused blocks disagree with their Hugging Face originals: {detail}. "
            "Fix: report this with the model config; load with pp_size=1.")
