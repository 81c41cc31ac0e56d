"""The pipelined `generate` (DeepSpeed-Inference §IV-B/C): micro-batches, dynamic queue, hybrid
schedule, finished sequences leaving - with HF's `generate()` semantics on the last stage.

Every rank calls `model.generate(...)` with the same arguments. HF's own `generate` prepares
the generation config, the logits processors, the stopping criteria and the model kwargs
(attention mask, position ids) on every rank, then calls `ScheduleLoop` as its decoding loop
(`custom_generate`), which replaces `_sample`:

- the batch's rows are cut into `pp_prompt_micro_batches` prompt micro-batches, and the
  generation phase joins them into `pp_micro_batches` generation micro-batches (the hybrid
  schedule: more, smaller micro-batches for the long prompt steps fill the pipeline better);
- stage 0 pushes every prompt micro-batch into the pipeline, then serves tokens as they come
  back: a micro-batch's next step starts the moment the last stage has sampled its token
  (dynamic queue, no barrier across the batch, so fill and drain are paid once);
- the last stage runs HF's logits processors, samples (greedy or from the RNG, in exactly the
  order HF's single process draws), applies the stopping criteria, streams, and sends the
  tokens with the rows that finished; finished rows leave every stage's micro-batch (and its
  KV cache) at that micro-batch's next step, an all-finished micro-batch leaves the queue
  (when generate must return scores / logits, or a row-wise criterion runs without EOS, rows
  stay to the end as in HF's loop, under the lock-step schedule: see _choose_row_policy);
- when every row has finished stage 0 sends STOP down the pipeline and the last stage's
  sequences are broadcast: every rank returns the same tensor, and all leave together.

Each stage keeps one DynamicCache per micro-batch, written only for its own layers
(pipeline.bind_stage_cache). A stage that raises sends ERROR on around the ring; a stage that
waits longer than `pp_timeout_s` raises: no rank hangs.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import DynamicCache
from transformers.generation.stopping_criteria import MaxLengthCriteria, MaxTimeCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import PipelineParallelError
from hf_dsinfer.hf import cache_args
from hf_dsinfer.parallel.pipeline import (
    MESSAGE_HEADER,
    StageRunner,
    bind_stage_cache,
    broadcast_from_last,
    finish_sends,
    micro_batch_counts,
    pack,
    peer_errors,
    unpack,
    wait_recv,
)

PROMPT, DECODE, TOKENS, STOP, ERROR = range(5)
_KINDS = ("PROMPT", "DECODE", "TOKENS", "STOP", "ERROR")
SCHEDULES = ("dynamic", "lockstep")
# criteria that stop every row at once (they cannot make rows of a batch differ)
_BATCH_WIDE_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria)
_REFUSED_OUTPUTS = ("output_attentions", "output_hidden_states")
_RETURNED_OUTPUTS = {"output_scores": "scores", "output_logits": "logits"}


def sync_rng_world() -> None:
    """Every rank starts generate from rank 0's torch RNG state (only the last stage samples;
    with every rank seeded alike, the tokens are those of one process seeded like rank 0)."""
    state = torch.get_rng_state()
    dist.broadcast(state, src=0)
    torch.set_rng_state(state)


class PipelinedGenerate:
    """Installed as `model.generate` on every pipeline rank.

    Extra keywords: `pp_schedule="dynamic"` (default) or `"lockstep"` (the baseline: stage 0
    waits for every micro-batch's token before any starts its next step); `pp_micro_batches`
    and `pp_prompt_micro_batches` override the config's for one call. After each call,
    `.last_stats` holds this rank's seconds serving prompt / decode items, waiting for
    messages, inside the model's forwards, and in the loop (benchmarks/pipeline.py)."""

    def __init__(self, model: nn.Module, runner: StageRunner, config: DSInferConfig):
        self.hf_generate = model.generate
        self.runner, self.config = runner, config
        self.last_stats: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        schedule = kwargs.pop("pp_schedule", "dynamic")
        if schedule not in SCHEDULES:
            raise PipelineParallelError(
                f"pp_schedule: expected one of {SCHEDULES}, got {schedule!r}. Fix: leave it out "
                "(dynamic queue) or pass 'lockstep' for the per-token barrier baseline.")
        for name in ("assistant_model", "custom_generate", "synced_gpus"):
            if kwargs.get(name) is not None:
                raise PipelineParallelError(
                    f"generate({name}=...) is not supported on a pipeline-parallel model (the "
                    f"pipelined loop replaces HF's decoding loop). Fix: drop {name}.")
        counts = {k: kwargs.pop(k) for k in ("pp_micro_batches", "pp_prompt_micro_batches")
                  if k in kwargs}
        config = self.config.replace(**counts) if counts else self.config  # validated
        streamer = kwargs.pop("streamer", None)
        sync_rng_world()
        loop = ScheduleLoop(self.runner, config, schedule,
                            streamer if self.runner.ranks.is_last else None)
        try:
            return self.hf_generate(*args, custom_generate=loop, **kwargs)
        finally:
            self.last_stats = loop.stats


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch's state on one stage."""

    rows: torch.Tensor        # [n] the batch rows it holds now (ascending)
    input_ids: torch.Tensor   # [n, L] prompt + tokens so far
    kwargs: dict[str, Any]    # HF model kwargs: attention_mask, position_ids, cache, ...
    steps: int = 0            # forwards run (0: the prompt is next)

    @property
    def cache(self) -> DynamicCache:
        return cache_args.model_cache(self.kwargs)


def _split_kwargs(kwargs: dict[str, Any], rows: torch.Tensor, batch: int) -> dict[str, Any]:
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            out[key] = value[rows]
        else:
            out[key] = value
    return out


def _select(mb: MicroBatch, alive: torch.Tensor, layers: range) -> None:
    """Keep only the rows in `alive` (finished sequences leave), in the cache too."""
    keep = torch.isin(mb.rows, alive)
    if bool(keep.all()):
        return
    idx = keep.nonzero().squeeze(1)
    n = mb.rows.shape[0]
    for key, value in list(mb.kwargs.items()):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            mb.kwargs[key] = value[idx]
    for i in layers:
        if i < len(mb.cache.layers):
            mb.cache.layers[i].batch_select_indices(idx)
    mb.rows, mb.input_ids = mb.rows[idx], mb.input_ids[idx]


def _merge(parts: list[MicroBatch], layers: range) -> MicroBatch:
    """Join prompt micro-batches (same padded length) into one generation micro-batch."""
    if len(parts) == 1:
        return parts[0]
    kwargs = {}
    for key, value in parts[0].kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim():
            kwargs[key] = torch.cat([p.kwargs[key] for p in parts])
        else:
            kwargs[key] = value
    cache = parts[0].cache
    for i in layers:
        if i < len(cache.layers) and cache.layers[i].is_initialized:
            own = [p.cache.layers[i] for p in parts]
            cache.layers[i].keys = torch.cat([layer.keys for layer in own])
            cache.layers[i].values = torch.cat([layer.values for layer in own])
    kwargs = cache_args.with_cache(kwargs, cache)
    return MicroBatch(torch.cat([p.rows for p in parts]),
                      torch.cat([p.input_ids for p in parts]), kwargs, parts[0].steps)


class DrawLedger:
    """Keeps sampling's random draws in HF's order. HF draws one multinomial over the whole
    batch per step; torch's CPU multinomial consumes the generator row by row, whatever the
    probabilities, so drawing micro-batch by micro-batch in row order - with stand-in rows for
    sequences that already left - consumes it exactly as one process does."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.next = sizes, (1, 0)

    def _advance(self) -> None:
        step, mb = self.next
        self.next = (step, mb + 1) if mb + 1 < len(self.sizes) else (step + 1, 0)

    def draw(self, step: int, mb: int, probs: torch.Tensor, positions: torch.Tensor
             ) -> torch.Tensor:
        vocab = probs.shape[-1]
        while self.next < (step, mb):  # micro-batches that left: HF still draws for their rows
            torch.multinomial(probs.new_full((self.sizes[self.next[1]], vocab), 1 / vocab), 1)
            self._advance()
        full = probs.new_full((self.sizes[mb], vocab), 1 / vocab)
        full[positions] = probs
        self._advance()
        return torch.multinomial(full, 1).squeeze(1)[positions]


class ScheduleLoop:
    """HF's decoding loop on a pipeline stage (passed as `custom_generate`)."""

    def __init__(self, runner: StageRunner, config: DSInferConfig, schedule: str,
                 streamer: Any):
        self.runner, self.ranks = runner, runner.ranks
        self.config, self.schedule, self.streamer = config, schedule, streamer
        self.pending: list = []
        self.posted: tuple[Any, torch.Tensor] | None = None
        # seconds spent per phase (everything a stage does for its items: forwards, HF's input
        # preparation, sampling, posting messages) and waiting for messages ("idle")
        self.stats: dict[str, Any] = {"wall_s": 0.0, "compute_s": 0.0, "prompt_s": 0.0,
                                      "decode_s": 0.0, "idle_s": 0.0, "prompt_forwards": 0,
                                      "decode_forwards": 0}
        self._phase: str | None = None
        self._since = 0.0

    # -- HF's entry: the signature of GenerationMixin._sample -----------------------------------
    def __call__(self, model: nn.Module, input_ids: torch.Tensor, logits_processor: Any,
                 stopping_criteria: Any, generation_config: Any, synced_gpus: bool = False,
                 streamer: Any = None, **model_kwargs: Any) -> Any:
        self._check(generation_config, model_kwargs)
        self.model, self.gen = model, generation_config
        self.processors, self.stopping = logits_processor, stopping_criteria
        self._choose_row_policy(generation_config, stopping_criteria)
        start = time.perf_counter()
        self._setup(input_ids, model_kwargs)
        self.runner.looping = True
        try:
            self._mark("prompt")
            self._run_role()
            self._mark("idle")
            finish_sends(self.pending, self.ranks, self._next_hop())
            self._mark(None)
        except BaseException as err:
            self._report_error(err)
            raise
        finally:
            self.runner.looping = False
            self.stats["wall_s"] = time.perf_counter() - start
        sequences = self._broadcast_sequences()
        if self.streamer is not None:
            self.streamer.end()
        if generation_config.return_dict_in_generate:
            steps = sequences.shape[1] - self.prompt_len
            return GenerateDecoderOnlyOutput(
                sequences=sequences, **{name: self._broadcast_recorded(name, steps)
                                        for name in self.want})
        return sequences

    def _choose_row_policy(self, gen: Any, stopping: Any) -> None:
        """Whether finished rows leave their micro-batches (the default) or stay to the end.

        HF pads finished rows only when an EOS criterion is present (otherwise they go on
        generating real tokens until every row is done), and its scores / logits have a row for
        every sequence at every step. Rows that leave cannot give either; so when scores or
        logits are asked for, or a row-wise criterion (a custom one, stop strings) runs without
        EOS, every row stays, and the lock-step schedule lets the last stage know at each step
        whether the whole batch has finished (the dynamic queue cannot: micro-batches are at
        different steps)."""
        self.want = [name for flag, name in _RETURNED_OUTPUTS.items()
                     if gen.return_dict_in_generate and getattr(gen, flag, False)]
        self.pad_finished = any(hasattr(c, "eos_token_id") for c in stopping)
        row_wise = any(not isinstance(c, _BATCH_WIDE_CRITERIA) for c in stopping)
        self.keep_rows = bool(self.want) or (row_wise and not self.pad_finished)
        if self.keep_rows:
            self.schedule = "lockstep"
        self.stats["schedule"] = self.schedule

    def _check(self, gen: Any, model_kwargs: dict[str, Any]) -> None:
        if gen.num_beams != 1:
            raise PipelineParallelError(
                f"generate(num_beams={gen.num_beams}) on a pipeline-parallel model: only greedy "
                "and sampling are pipelined. Fix: num_beams=1.")
        asked = [name for name in _REFUSED_OUTPUTS if getattr(gen, name, False)]
        if asked and gen.return_dict_in_generate:
            raise PipelineParallelError(
                f"generate({asked[0]}=True) on a pipeline-parallel model: attentions and hidden "
                "states stay on the stage that computed them. Fix: drop it (output_scores and "
                "output_logits are returned).")
        cache = cache_args.model_cache(model_kwargs)
        if not model_kwargs.get("use_cache", True) or (cache is not None
                                                       and cache.get_seq_length() > 0):
            raise PipelineParallelError(
                "generate on a pipeline-parallel model needs use_cache=True and starts from an "
                "empty cache (each stage keeps per-micro-batch caches of its own layers). Fix: "
                "drop use_cache=False / cache= (past_key_values=).")

    # -- set-up ----------------------------------------------------------------------------------
    def _setup(self, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
        batch = input_ids.shape[0]
        gen_mb, prompt_mb = micro_batch_counts(self.config)
        prompt_mb = min(prompt_mb, batch)
        gen_mb = min(gen_mb, prompt_mb)
        chunks = torch.arange(batch, device=input_ids.device).tensor_split(prompt_mb)
        self.prompts = [self._micro_batch(rows, input_ids, model_kwargs) for rows in chunks]
        self.groups = [g.tolist() for g in torch.arange(prompt_mb).tensor_split(gen_mb)]
        self.group_of = {p: g for g, members in enumerate(self.groups) for p in members}
        self.gens: dict[int, MicroBatch] = {}
        self.first_tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prompt_len, self.batch = input_ids.shape[1], batch
        self.stats.update(prompt_micro_batches=prompt_mb, micro_batches=gen_mb)
        if self.ranks.is_last:
            sizes = [sum(len(chunks[p]) for p in g) for g in self.groups]
            self.ledger = DrawLedger(sizes)
            self.origin = [torch.cat([chunks[p] for p in g]) for g in self.groups]
            self.sequences = input_ids.new_full((batch, self.gen.max_length),
                                                int(self._pad()))
            self.sequences[:, :self.prompt_len] = input_ids
            self.length = self.prompt_len
            self.unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
            self.recorded: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.want}
            self.held: list[tuple[int, int, torch.Tensor]] = []
            if self.streamer is not None:
                self.streamer.put(input_ids.cpu())

    def _pad(self) -> int:
        pad = self.gen._pad_token_tensor
        return 0 if pad is None else int(pad)

    def _micro_batch(self, rows: torch.Tensor, input_ids: torch.Tensor,
                     model_kwargs: dict[str, Any]) -> MicroBatch:
        kwargs = _split_kwargs(model_kwargs, rows, input_ids.shape[0])
        cache = DynamicCache(config=self.model.config)
        bind_stage_cache(cache, self.runner.layers)
        return MicroBatch(rows, input_ids[rows], cache_args.with_cache(kwargs, cache))

    def _generation_mb(self, g: int) -> MicroBatch:
        if g not in self.gens:
            self.gens[g] = _merge([self.prompts[p] for p in self.groups[g]], self.runner.layers)
        return self.gens[g]

    # -- one forward of this stage ---------------------------------------------------------------
    def _forward(self, mb: MicroBatch, incoming: torch.Tensor | None) -> Any:
        first = mb.steps == 0
        inputs = self.model.prepare_inputs_for_generation(
            mb.input_ids, next_sequence_length=None if first else 1, is_first_iteration=first,
            **mb.kwargs)
        if self.ranks.is_last:
            forward = self.model
            inputs["return_dict"] = True
        else:
            forward = getattr(self.model, "base_model", self.model)
            inputs.pop("logits_to_keep", None)
        start = time.perf_counter()
        out, hidden = self.runner.run(forward, inputs, incoming)
        self.stats["compute_s"] += time.perf_counter() - start
        self.stats["prompt_forwards" if first else "decode_forwards"] += 1
        mb.kwargs = self.model._update_model_kwargs_for_generation(
            CausalLMOutputWithPast(**{cache_args.KEYWORD: mb.cache}), mb.kwargs)
        mb.steps += 1
        return out if self.ranks.is_last else hidden

    # -- messages --------------------------------------------------------------------------------
    def _send(self, dst: int, kind: int, mb: int = 0, step: int = 0,
              tensors: tuple[torch.Tensor, ...] = ()) -> None:
        head, payload = pack((kind, mb, step, dist.get_rank()), tensors)
        with peer_errors(self.ranks, dst, f"sending {_KINDS[kind]} to"):
            self.pending.append((dist.isend(head, dst), head))
            if payload.numel():
                self.pending.append((dist.isend(payload, dst), payload))
            self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def _mark(self, phase: str | None) -> None:
        """Close the running time segment (charged to the phase being served) and open one."""
        now = time.perf_counter()
        if self._phase is not None:
            self.stats[f"{self._phase}_s"] += now - self._since
        self._phase, self._since = phase, now

    def _post(self, src: int) -> None:
        """Post the receive of the next message's header now, so that its rendezvous with the
        sender happens while this stage computes (only when another message will come)."""
        head = torch.empty(MESSAGE_HEADER, dtype=torch.int64)
        self.posted = (dist.irecv(head, src), head)

    def _recv(self, src: int, what: str) -> tuple[int, int, int, list[torch.Tensor]]:
        self._mark("idle")
        if self.posted is None:
            self._post(src)
        (work, head), self.posted = self.posted, None
        wait_recv(work, self.ranks, src, what)
        kind, mb, step, origin = (int(v) for v in head[:4])
        if kind == ERROR:
            self._forward_error(origin)
            raise PipelineParallelError(
                f"pipeline rank {origin} (stage {origin // self.ranks.width}) failed during "
                f"generate; stage {self.ranks.stage} (rank {dist.get_rank()}) stops too. Fix: "
                "see that rank's error.")
        payload = torch.empty(int(head[5]), dtype=torch.uint8)
        if payload.numel():
            wait_recv(dist.irecv(payload, src), self.ranks, src, what)
        tensors = unpack(head, payload)
        self._mark("prompt" if kind == PROMPT or (kind == TOKENS and step == 0) else "decode")
        return kind, mb, step, tensors

    def _next_hop(self) -> int:
        return self.ranks.first if self.ranks.is_last else self.ranks.next

    def _forward_error(self, origin: int) -> None:
        """Pass the failure of rank `origin` on around the ring (best effort: a neighbour that
        is gone already is not waited for longer than a few seconds)."""
        if self._next_hop() != origin:
            head, _ = pack((ERROR, 0, 0, origin), ())
            work = dist.isend(head, self._next_hop())
            try:
                work.wait(timeout=min(self.ranks.timeout, datetime.timedelta(seconds=5)))
            except RuntimeError:
                pass  # that rank is gone: it cannot hang on us

    def _report_error(self, err: BaseException) -> None:
        if isinstance(err, PipelineParallelError) or not dist.is_initialized():
            return  # a neighbour's failure, already passed on (or a timeout)
        try:
            self._forward_error(dist.get_rank())
        except RuntimeError:
            pass  # the original error is what matters

    # -- roles -----------------------------------------------------------------------------------
    def _run_role(self) -> None:
        if self.ranks.is_first:
            self._run_first()
        elif self.ranks.is_last:
            self._run_last()
        else:
            self._run_middle()

    def _run_first(self) -> None:
        for p, mb in enumerate(self.prompts):
            self._send(self.ranks.next, PROMPT, p, 0, (self._forward(mb, None),))
        live = set(range(len(self.groups)))
        talking = set(live)  # micro-batches that will send tokens again
        waiting: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        while live:
            _, g, step, (tokens, finished) = self._recv(self.ranks.last, "generated tokens")
            if bool(finished.all()):
                talking.discard(g)
            if talking:
                self._post(self.ranks.last)
            waiting.append((g, step, tokens, finished.bool()))
            if self.schedule == "lockstep" and len(waiting) < len(live):
                continue  # the baseline: a barrier across the batch at every token
            for g, step, tokens, finished in waiting:
                mb = self._generation_mb(g)
                alive, new = mb.rows[~finished], tokens[~finished].unsqueeze(1)
                if alive.numel() == 0:
                    live.discard(g)
                    continue
                self._advance(mb, alive, new)
                self._send(self.ranks.next, DECODE, g, step + 1,
                           (alive, new, self._forward(mb, None)))
            waiting.clear()
        self._send(self.ranks.next, STOP)

    def _advance(self, mb: MicroBatch, alive: torch.Tensor, new: torch.Tensor) -> None:
        _select(mb, alive, self.runner.layers)
        mb.input_ids = torch.cat([mb.input_ids, new.to(mb.input_ids.device)], dim=-1)

    def _run_middle(self) -> None:
        while True:
            kind, i, step, tensors = self._recv(self.ranks.prev, "a hidden state")
            if kind == STOP:
                self._send(self.ranks.next, STOP)
                return
            self._post(self.ranks.prev)
            if kind == PROMPT:
                hidden = self._forward(self.prompts[i], tensors[0])
                self._send(self.ranks.next, PROMPT, i, 0, (hidden,))
                continue
            alive, new, incoming = tensors
            mb = self._generation_mb(i)
            self._advance(mb, alive, new)
            self._send(self.ranks.next, DECODE, i, step, (alive, new, self._forward(mb, incoming)))

    def _run_last(self) -> None:
        while True:
            kind, i, step, tensors = self._recv(self.ranks.prev, "a hidden state")
            if kind == STOP:
                return
            self._post(self.ranks.prev)
            if kind == PROMPT:
                self._last_prompt(i, tensors[0])
                continue
            alive, _, incoming = tensors
            mb = self._generation_mb(i)
            _select(mb, alive, self.runner.layers)
            tokens, finished = self._sample(mb, self._forward(mb, incoming), step, i)
            self._send_tokens(i, step, tokens, finished)

    def _last_prompt(self, p: int, incoming: torch.Tensor) -> None:
        mb = self.prompts[p]
        tokens, finished = self._sample(mb, self._forward(mb, incoming), 0, None)
        self.first_tokens[p] = (tokens, finished)
        g = self.group_of[p]
        if p == self.groups[g][-1]:  # the generation micro-batch's prompts are all done
            parts = [self.first_tokens.pop(q) for q in self.groups[g]]
            self._generation_mb(g)
            self._send_tokens(g, 0, *(torch.cat(x) for x in zip(*parts)))

    def _send_tokens(self, g: int, step: int, tokens: torch.Tensor,
                     finished: torch.Tensor) -> None:
        """Send a micro-batch's tokens to stage 0. With rows kept to the end, the step's
        messages wait until every micro-batch has sampled it: then all rows are marked
        finished (the whole batch is) or none."""
        if not self.keep_rows:
            self._send(self.ranks.first, TOKENS, g, step, (tokens, finished))
            return
        self.held.append((g, step, tokens))
        if len(self.held) < len(self.groups):
            return
        done = int(not bool(self.unfinished.any()))
        for mb, at, sampled in self.held:
            self._send(self.ranks.first, TOKENS, mb, at, (sampled, torch.full_like(sampled, done)))
        self.held.clear()

    # -- HF's token selection, on the last stage -------------------------------------------------
    def _sample(self, mb: MicroBatch, out: Any, step: int, g: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32, device=mb.input_ids.device)
        scores = self.processors(mb.input_ids, logits)
        for name, value in (("scores", scores), ("logits", logits)):
            if name in self.want:
                per_step = self.recorded[name]
                if step not in per_step:
                    per_step[step] = value.new_zeros(self.batch, value.shape[-1])
                per_step[step][mb.rows] = value
        if self.gen.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            if g is None:  # the prompt step: micro-batches in row order, no row has left
                tokens = torch.multinomial(probs, 1).squeeze(1)
            else:
                positions = torch.searchsorted(self.origin[g], mb.rows)
                tokens = self.ledger.draw(step, g, probs, positions)
        else:
            tokens = torch.argmax(scores, dim=-1)
        live = self.unfinished[mb.rows]
        if self.pad_finished:  # HF's padding of finished rows (only rows kept to the end)
            tokens = torch.where(live, tokens, tokens.new_tensor(self._pad()))
        mb.input_ids = torch.cat([mb.input_ids, tokens[:, None]], dim=-1)
        self.unfinished[mb.rows] = live & ~self.stopping(mb.input_ids, scores)
        finished = ~self.unfinished[mb.rows]
        self.sequences[mb.rows, self.prompt_len + step] = tokens
        self.length = max(self.length, self.prompt_len + step + 1)
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        return tokens, finished.to(torch.int64)

    def _broadcast_recorded(self, name: str, steps: int) -> tuple[torch.Tensor, ...]:
        """The last stage's scores or logits [batch, vocab] per generated step, on every rank
        (broadcast along this rank's pipeline lane)."""
        mine = None
        if self.ranks.is_last:
            mine = torch.stack([self.recorded[name][t] for t in range(steps)])
        return tuple(broadcast_from_last(mine, self.ranks, torch.device("cpu")).unbind(0))

    def _broadcast_sequences(self) -> torch.Tensor:
        """The last stage's sequences on every rank (all ranks leave generate together)."""
        source = (self.ranks.size - 1) * self.ranks.width
        length = torch.tensor([self.length if self.ranks.is_last else 0])
        dist.broadcast(length, src=source)
        if self.ranks.is_last:
            out = self.sequences[:, : int(length)].contiguous()
        else:
            out = torch.empty(self.batch, int(length), dtype=torch.int64)
        dist.broadcast(out, src=source)
        return out
