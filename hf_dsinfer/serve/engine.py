"""The serving engine: one transformers ContinuousBatchingManager over the (injected) model.

The manager runs the model in its own thread, packing every admitted request into one row over a
paged KV cache. The engine adds what a server needs around it:

- admission: at most `max_requests` requests in flight (generating or queued; beyond: 429), and
  a KV-block reservation per request (prompt + max_new_tokens, rounded up to pages) so the
  requests handed to the manager always fit its cache: a request that does not fit yet waits in
  a FIFO here instead of making the manager run out of blocks;
- delivery: the manager's outputs reach a per-request callback on the event loop (HF's
  `register_result_handler`); every request is submitted as streaming so the engine sees each
  token (for tok/s and time to first token) whatever the client asked for;
- cancellation: `cancel` asks the manager to drop the request (its KV blocks are freed on the
  manager's next step) and forgets its handler;
- faults: a request failed by the manager arrives with `output.error`; when the manager's thread
  died, new requests are refused (503) with its exception, `/health` reports it, and `stop`
  returns it so the command line exits non-zero;
- metrics: queue depth, KV blocks in use (read from the cache's block tables), tok/s.

All methods except `start`, `stop` and `metrics` run on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_dsinfer.api import fused_call_counts
from hf_dsinfer.errors import ContinuousBatchingError, ServeError

logger = logging.getLogger(__name__)

TOKS_WINDOW_S = 10.0  # tok/s is measured over the last TOKS_WINDOW_S seconds


@dataclass(frozen=True)
class ServeLimits:
    """What the server admits. `max_model_len` None: the model's max_position_embeddings."""

    max_requests: int = 64  # in flight (generating or waiting for KV blocks); beyond: 429
    max_model_len: int | None = None  # prompt + max_tokens
    default_max_tokens: int = 256  # when a request does not say
    stop_timeout_s: float = 30.0  # graceful stop: in-flight requests get this long to finish

    def __post_init__(self) -> None:
        for name in ("max_requests", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeLimits.{name}: expected a positive int, got {value!r}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"ServeLimits.max_model_len: expected >= 2 or None, got "
                             f"{self.max_model_len!r}.")


@dataclass
class Admitted:
    """One admitted request, from submit until it finished, failed or was cancelled."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    blocks: int  # KV blocks it may occupy (whole-model blocks, worst case)
    sink: Callable[[Any], None]  # gets each GenerationOutput, on the event loop
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: int = 0
    reserved: bool = False  # its blocks are counted in Engine._reserved
    outcome: str | None = None  # completed | failed | cancelled


class Engine:
    """A model, its tokenizer and one continuous-batching manager, behind admission control."""

    def __init__(self, model: Any, tokenizer: Any, model_name: str, *,
                 cb_config: ContinuousBatchingConfig | None = None,
                 generation_config: GenerationConfig | None = None,
                 limits: ServeLimits | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits or ServeLimits()
        self.cb_config = cb_config or ContinuousBatchingConfig()
        self.generation_config = generation_config or greedy_config(model)
        self.max_model_len = self.limits.max_model_len or _model_max_len(model)
        self.created = int(time.time())
        self.manager: Any = None
        self.fatal_error: BaseException | None = None
        self._requests: dict[str, Admitted] = {}
        self._waiters: deque[tuple[Admitted, asyncio.Future]] = deque()
        self._reserved = 0
        self._stopping = False
        self._tokens: deque[tuple[float, int]] = deque()  # (time, new tokens) for tok/s
        self._lock = threading.Lock()  # metrics() may run on another thread
        self.counts = dict.fromkeys(("submitted", "completed", "failed", "cancelled",
                                     "rejected", "tokens"), 0)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        """Start the manager's thread and wait until it built its paged cache (or failed)."""
        self.manager = self.model.init_continuous_batching(
            generation_config=self.generation_config, continuous_batching_config=self.cb_config)
        self.manager.start()
        deadline = time.monotonic() + timeout_s
        while self.manager.batch_processor is None and time.monotonic() < deadline:
            if self._manager_error() is not None or not self.manager.is_running():
                break
            time.sleep(0.01)
        error = self._manager_error()
        if error is not None or self.manager.batch_processor is None:
            self.manager.stop(block=True, timeout=5)
            raise ContinuousBatchingError(
                "hf-dsinfer serve: the continuous batching manager did not start: "
                f"{error!r}" if error is not None else f"no paged cache after {timeout_s:.0f} s."
            ) from error
        self.sampling_keys = dict(self.manager.logit_processor.supported_keys)

    @property
    def drives(self) -> bool:
        """False on a tensor-parallel rank other than 0: its manager follows rank 0's schedule
        step by step (transformers' TP mode), takes no requests and answers none."""
        return self.manager is None or bool(getattr(self.manager, "is_tp_driver", True))

    def follow(self, poll_s: float = 0.1) -> BaseException | None:
        """On a following rank: run until rank 0's manager stops (its stop reaches every rank
        of the group at the next step). Returns the manager thread's fatal error, if any.

        Ctrl-C (torchrun hands it to every rank) does not stop a follower: rank 0 drains its
        requests and stops the group. Past limits.stop_timeout_s + 30 s after it, the follower
        stops its manager itself."""
        interrupted = None
        while self.manager is not None and self.manager.is_running():
            try:
                time.sleep(poll_s)
            except KeyboardInterrupt:
                interrupted = interrupted or time.monotonic()
            if interrupted and time.monotonic() - interrupted > self.limits.stop_timeout_s + 30:
                logger.error("hf-dsinfer serve: rank 0 did not stop the group; stopping here")
                self.manager.stop(block=True, timeout=10, hard_stop=True)
                break
        self.fatal_error = self._manager_error()
        return self.fatal_error

    async def aclose(self) -> BaseException | None:
        """`stop` from the event loop: requests waiting for KV blocks get 503, and the loop keeps
        delivering the outputs of requests in flight while the manager drains."""
        self._stopping = True
        for _, waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_exception(_shutting_down())
        return await asyncio.to_thread(self.stop)

    def stop(self) -> BaseException | None:
        """Refuse new requests, let those in flight finish (up to limits.stop_timeout_s, then a
        hard stop fails them), stop the manager's thread. Returns the manager thread's fatal
        error, if it had one (also logged)."""
        self._stopping = True
        if self.manager is not None and self.manager.is_running():
            self.manager.stop(block=True, timeout=self.limits.stop_timeout_s)
            if self.manager.is_running():
                logger.error("hf-dsinfer serve: requests still running after %.0f s; hard stop",
                             self.limits.stop_timeout_s)
                self.manager.stop(block=True, timeout=10, hard_stop=True)
        self.fatal_error = self._manager_error()
        if self.fatal_error is not None:
            logger.error("hf-dsinfer serve: the generation thread had failed: %r",
                         self.fatal_error, exc_info=self.fatal_error)
        return self.fatal_error

    def _manager_error(self) -> BaseException | None:
        if self.manager is None:
            return None
        return self.manager.background_thread_status.fatal_error

    def health(self) -> tuple[bool, str]:
        """(healthy, reason)."""
        error = self._manager_error()
        if error is not None:
            return False, f"the generation thread failed: {error!r}"
        if self._stopping:
            return False, "shutting down"
        if self.manager is None or not self.manager.is_running():
            return False, "the generation thread is not running"
        return True, "ok"

    # -- requests -------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Whole-model KV blocks a sequence of `tokens` tokens can occupy at most."""
        return math.ceil(tokens / self.cb_config.page_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.cb_config.page_size

    @property
    def kv_blocks_total(self) -> int:
        return self.manager.batch_processor.cache.num_blocks

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: dict,
                     sink: Callable[[Any], None]) -> Admitted:
        """Admit a request and hand it to the manager. Raises ServeError 429 beyond
        max_requests, 503 while stopping or after the generation thread died. Waits (FIFO) while
        the KV blocks it may need are reserved by requests in flight."""
        self.check_accepting()
        if len(self._requests) >= self.limits.max_requests:
            self.counts["rejected"] += 1
            raise ServeError(429, f"server busy: {len(self._requests)} requests in flight, the "
                             f"limit is {self.limits.max_requests} (--max-requests). Fix: retry "
                             "later.", code="too_many_requests")
        blocks = self.blocks_for(len(prompt_ids) + max_new_tokens)
        admitted = Admitted(f"cmpl-{uuid.uuid4().hex}", len(prompt_ids), max_new_tokens, blocks,
                            sink)
        self._requests[admitted.request_id] = admitted
        self.counts["submitted"] += 1
        try:
            await self._reserve(admitted)
            self.check_accepting()
        except BaseException:  # cancelled while waiting, or stopping
            self._forget(admitted, "cancelled")
            raise
        self._hand_to_manager(admitted, prompt_ids, sampling)
        return admitted

    def check_accepting(self) -> None:
        error = self._manager_error()
        if error is not None:
            raise ServeError(503, f"the generation thread failed and the server cannot generate: "
                             f"{error!r}. Fix: restart the server (its log has the traceback).",
                             code="generation_thread_failed")
        if self._stopping:
            raise _shutting_down()

    async def _reserve(self, admitted: Admitted) -> None:
        if not self._waiters and self._reserved + admitted.blocks <= self.kv_blocks_total:
            self._take_blocks(admitted)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((admitted, waiter))
        try:
            await waiter  # _wake_waiters reserves for it before resolving
        finally:
            self._waiters = deque(w for w in self._waiters if w[1] is not waiter)

    def _take_blocks(self, admitted: Admitted) -> None:
        self._reserved += admitted.blocks
        admitted.reserved = True

    def _wake_waiters(self) -> None:
        """FIFO: wake the oldest waiters whose blocks now fit."""
        while self._waiters:
            admitted, waiter = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self._reserved + admitted.blocks > self.kv_blocks_total:
                return
            self._waiters.popleft()
            self._take_blocks(admitted)
            waiter.set_result(None)

    def _hand_to_manager(self, admitted: Admitted, prompt_ids: list[int], sampling: dict) -> None:
        rid = admitted.request_id
        self.manager.register_result_handler(rid, lambda out: self._on_output(admitted, out))
        added = self.manager.add_request(
            prompt_ids, request_id=rid, max_new_tokens=admitted.max_new_tokens, streaming=True,
            eos_token_id=self.generation_config.eos_token_id, **sampling)
        if added is None:  # the manager refused: stopping or dead (it logged why)
            self._drop_handler(rid)
            self._forget(admitted, "failed")
            self.check_accepting()
            raise ServeError(503, "the generation thread is not accepting requests. Fix: restart "
                             "the server.", code="generation_thread_stopped")

    def _on_output(self, admitted: Admitted, output: Any) -> None:
        if admitted.outcome is not None:
            return  # cancelled: late outputs are dropped
        new = len(output.generated_tokens) - admitted.tokens
        if new > 0:
            now = time.perf_counter()
            admitted.first_token = admitted.first_token or now
            admitted.tokens += new
            with self._lock:
                self._tokens.append((now, new))
                self.counts["tokens"] += new
        if output.is_finished():
            self._forget(admitted, "failed" if output.error is not None else "completed")
        admitted.sink(output)

    def cancel(self, admitted: Admitted) -> None:
        """Drop a request (client gone): the manager frees its KV blocks on its next step."""
        if admitted.outcome is not None:
            return
        if self.manager is not None:
            self.manager.cancel_request(admitted.request_id)
            self._drop_handler(admitted.request_id)
        self._forget(admitted, "cancelled")

    def _drop_handler(self, request_id: str) -> None:
        router = self.manager.output_router
        with router._lock:
            router.result_handlers.pop(request_id, None)

    def _forget(self, admitted: Admitted, outcome: str) -> None:
        if admitted.outcome is not None:
            return
        admitted.outcome = outcome
        self.counts[outcome] += 1
        self._requests.pop(admitted.request_id, None)
        if admitted.reserved:
            self._reserved -= admitted.blocks
            admitted.reserved = False
        self._wake_waiters()

    # -- metrics --------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Queue depth, KV blocks, tok/s and request counts (safe from any thread)."""
        processor = self.manager.batch_processor if self.manager is not None else None
        running = waiting = 0
        blocks: dict[str, int] = {}
        cached = 0
        if processor is not None:
            scheduler = processor.scheduler
            running, waiting = len(scheduler.active_requests), len(scheduler.waiting_requests)
            blocks, cached = _blocks_in_use(processor.cache)
        waiting += self.manager.input_queue.qsize() if self.manager is not None else 0
        healthy, reason = self.health()
        return {
            "model": self.model_name,
            "healthy": healthy,
            "status": reason,
            "requests_running": running,
            "requests_waiting": waiting + len(self._waiters),  # manager's queue + KV wait here
            "requests_waiting_for_kv": len(self._waiters),
            "requests_in_flight": len(self._requests),
            "max_requests": self.limits.max_requests,
            "kv_blocks_in_use": sum(blocks.values()),
            "kv_blocks_in_use_by_attention_type": blocks,
            "kv_blocks_cached_prefixes": cached,
            "kv_blocks_reserved": self._reserved,
            "kv_blocks_total": self.kv_blocks_total if processor is not None else 0,
            "kv_page_size": self.cb_config.page_size,
            "tokens_per_second": self._tokens_per_second(),
            **{f"requests_{k}_total": v for k, v in self.counts.items() if k != "tokens"},
            "tokens_generated_total": self.counts["tokens"],
            # proof the fused blocks ran (0: a model served without hf_dsinfer)
            "fused_block_calls": sum(fused_call_counts(self.model).values()),
        }

    def _tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._tokens and self._tokens[0][0] < now - TOKS_WINDOW_S:
                self._tokens.popleft()
            total = sum(n for _, n in self._tokens)
        return round(total / TOKS_WINDOW_S, 2)


def _blocks_in_use(cache: Any) -> tuple[dict[str, int], int]:
    """({attention type: distinct KV blocks referenced by requests}, cached prefix blocks).
    Read from another thread than the manager's: dict copies under the GIL, retried if the
    manager resized one meanwhile."""
    for _ in range(5):
        try:
            in_use = {name: len({b for table in list(alloc.block_table.values()) for b in table})
                      for name, alloc in cache.cache_allocators.items()}
            cached = sum(len(alloc.ledger.cached_blocks) for alloc in cache.cache_allocators.values()
                         if hasattr(alloc, "ledger"))
            return in_use, cached
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return {}, 0


def _shutting_down() -> ServeError:
    return ServeError(503, "the server is shutting down. Fix: retry on another replica or later.",
                      code="shutting_down")


def _model_max_len(model: Any) -> int:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096


def greedy_config(model: Any, max_new_tokens: int = 256) -> GenerationConfig:
    """The model's generation config, greedy: HF's manager samples with one config for every
    request, so the server's decoding mode is chosen at start (see sampling_config)."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.temperature = config.top_p = config.top_k = None
    config.max_new_tokens = max_new_tokens
    if config.eos_token_id is None:
        config.eos_token_id = model.config.eos_token_id
    return config


def sampling_config(model: Any, temperature: float, top_p: float, top_k: int,
                    max_new_tokens: int = 256) -> GenerationConfig:
    """Sampling with these defaults; requests may override temperature / top_p / top_k (HF's
    per-request processors; a processor exists only where the default is not neutral)."""
    config = greedy_config(model, max_new_tokens)
    config.do_sample = True
    config.temperature, config.top_p, config.top_k = temperature, top_p, top_k
    return config
