"""`hf-dsinfer serve`: load the model (embedded SmolLM2 by default), start continuous batching,
serve the OpenAI-compatible app with uvicorn until SIGINT / SIGTERM.

    hf-dsinfer serve                                   # SmolLM2-135M-Instruct, fused, fp32
    hf-dsinfer serve --model ./my-model --port 8001 --dsinfer '{"quant": {"bits": 8}}'
    hf-dsinfer serve --quant int4 --dtype bfloat16 --max-requests 32 --do-sample
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_dsinfer import default_model

SERVE_HELP = "OpenAI-compatible HTTP server with continuous batching (docs/serving.md)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("serve", help=SERVE_HELP, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M)")
    add("--served-model-name", default=None, help="the `model` clients name (default: the "
        "folder's name, SmolLM2-135M-Instruct for the default)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--dsinfer", default=None, metavar="JSON", help="DSInferConfig fields as JSON, e.g. "
        "'{\"quant\": {\"bits\": 4}}' (the flags below add to it)")
    add("--no-dsinfer", action="store_true", help="serve the plain HF model (for comparison)")
    add("--dtype", default="float32", help="float32 | bfloat16 | float16")
    add("--quant", choices=list(default_model.QUANT_FLAGS), default=None,
        help="weight quantization (int4-a8: 4-bit weights, 8-bit activations)")
    add("--max-requests", type=int, default=64, help="requests in flight (generating or "
        "queued) beyond which the server answers 429")
    add("--max-model-len", type=int, default=None, help="prompt + max_tokens limit (default: "
        "the model's max_position_embeddings)")
    add("--default-max-tokens", type=int, default=256, help="max_tokens when a request omits it")
    add("--num-blocks", type=int, default=256, help="KV cache blocks (of --page-size tokens)")
    add("--page-size", type=int, default=32, help="tokens per KV block")
    add("--max-batch-tokens", type=int, default=256, help="tokens per forward (chunked prefill "
        "budget shared with decode)")
    add("--do-sample", action="store_true", help="sample (default: greedy for every request)")
    add("--temperature", type=float, default=0.7, help="with --do-sample: default temperature")
    add("--top-p", type=float, default=0.95, help="with --do-sample: default top_p")
    add("--top-k", type=int, default=50, help="with --do-sample: default top_k")
    add("--seed", type=int, default=None, help="with --do-sample: the sampler's seed")
    add("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get "
        "to finish on shutdown")
    add("--log-level", default="warning")
    parser.set_defaults(func=cmd_serve)
    return parser


def dsinfer_options(args: argparse.Namespace) -> bool | dict:
    """False (plain HF) or a DSInferConfig dict from --dsinfer JSON plus the flags."""
    return default_model.dsinfer_options(args, "serve")


def build_engine(args: argparse.Namespace, model: Any, tokenizer: Any, name: str):
    """The Engine (not started) around a loaded model, from the command line's options."""
    from transformers import ContinuousBatchingConfig

    from hf_dsinfer.serve.engine import Engine, ServeLimits, greedy_config, sampling_config

    limits = ServeLimits(max_requests=args.max_requests, max_model_len=args.max_model_len,
                         default_max_tokens=args.default_max_tokens,
                         stop_timeout_s=args.shutdown_timeout)
    cb = ContinuousBatchingConfig(num_blocks=args.num_blocks, page_size=args.page_size,
                                  max_batch_tokens=args.max_batch_tokens, seed=args.seed,
                                  per_request_processors=args.do_sample)
    config = (sampling_config(model, args.temperature, args.top_p, args.top_k,
                              args.default_max_tokens) if args.do_sample
              else greedy_config(model, args.default_max_tokens))
    return Engine(model, tokenizer, args.served_model_name or name, cb_config=cb,
                  generation_config=config, limits=limits)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model (the embedded default without --model) and serve it until SIGINT /
    SIGTERM; 1 if the generation thread had failed."""
    from hf_dsinfer.config import parse_dtype
    from hf_dsinfer.default_model import DEFAULT_GGUF, load

    logging.basicConfig(level=args.log_level.upper())
    model, tokenizer = off_main_thread(load, args.model, dsinfer_options(args),
                                       parse_dtype(args.dtype))
    return serve(args, model, tokenizer, Path(args.model or DEFAULT_GGUF).name.split(".")[0])


def off_main_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a thread of its own that ends when fn returns: its result, or its exception
    raised here.

    Why: torch's ops and the native kernels run on OpenMP (libgomp), which gives every thread
    that starts parallel work a pool of worker threads of its own, kept until that thread ends.
    While the pools hold more threads than the process has CPUs, libgomp's idle workers stop
    spinning and sleep, so every parallel region pays a wake-up: measured on 2 cores, a 64k
    torch.add took 3.8 us in the only pool and 20 us in a second one, and 30 SmolLM2 layers of
    16 decode rows 10.7 ms against 25 ms. Continuous batching computes on its own thread, so
    the server loads the model and builds the paged cache on threads that end, and the main
    thread (uvicorn's) runs no parallel torch work: the generation thread's pool is the only
    one."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = error

    thread = threading.Thread(target=run, name=f"hf-dsinfer {getattr(fn, '__name__', 'work')}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def torch_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def serve(args: argparse.Namespace, model: Any, tokenizer: Any, name: str) -> int:
    """Serve a loaded model until SIGINT / SIGTERM; 1 if the generation thread had failed."""
    import uvicorn

    from hf_dsinfer.serve.app import create_app

    engine = build_engine(args, model, tokenizer, name)
    off_main_thread(engine.start)  # the paged cache is built before the port opens; failures
    # raise here (off the main thread: see off_main_thread)
    if not engine.drives:  # tensor parallel: rank 0 answers, the other ranks follow it
        print(f"hf-dsinfer serve: rank {torch_rank()} follows rank 0's schedule", flush=True)
        error = engine.follow()
        return 0 if error is None else 1
    print(f"hf-dsinfer serve: {engine.model_name} on http://{args.host}:{args.port} "
          f"({engine.kv_blocks_total} KV blocks of {args.page_size} tokens, "
          f"max {args.max_requests} requests in flight)", flush=True)
    uvicorn.run(create_app(engine), host=args.host, port=args.port,
                log_level=args.log_level.lower(),
                timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)))
    # the app's shutdown stopped the engine; stop it here too if uvicorn exited without that
    running = engine.manager is not None and engine.manager.is_running()
    error = engine.stop() if running else engine.fatal_error
    if error is not None:
        print(f"hf-dsinfer serve: the generation thread had failed: {error!r}", flush=True)
        return 1
    return 0
