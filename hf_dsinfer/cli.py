"""`hf-dsinfer` command line: generate and explain.

    hf-dsinfer generate "What is the capital of France?"     # embedded SmolLM2-135M-Instruct
    hf-dsinfer generate "Hello" --model ./my-model --max-new-tokens 64 --no-dsinfer
    hf-dsinfer explain --model ./my-model
    hf-dsinfer bench --models llama-1.1b --batch 1 16      # HF vs hf_dsinfer decode table + PNG
    hf-dsinfer plan --model ./opt-2.7b --prompt-len 512 --gen-len 32 --memory 2.5GiB
    hf-dsinfer serve --port 8000                         # OpenAI-compatible server (docs/serving.md)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_dsinfer.default_model import QUANT_FLAGS, chat_inputs, dsinfer_options, load

DEFAULT_PROMPT = "What is the capital of France?"

def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    model, tokenizer = load(args.model, dsinfer_options(args, "generate"), _dtype(args.dtype))
    inputs = chat_inputs(tokenizer, args.prompt)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             streamer=streamer, pad_token_id=tokenizer.pad_token_id
                             or tokenizer.eos_token_id)
    seconds = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    mode = "hf_dsinfer" if not args.no_dsinfer else "HF eager (--no-dsinfer)"
    print(f"\n[{mode}] {new} tokens in {seconds:.2f} s: {new / seconds:.1f} tok/s", flush=True)
    return 0



def cmd_explain(args: argparse.Namespace) -> int:
    import hf_dsinfer

    model, _ = load(args.model, True, _dtype(args.dtype))
    print(hf_dsinfer.explain(model))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hf_dsinfer.benchmark import main as bench_main

    return bench_main(args)


def _dtype(name: str) -> torch.dtype:
    from hf_dsinfer.config import parse_dtype

    return parse_dtype(name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dsinfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (chat template when the model has one)")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    gen.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--no-dsinfer", action="store_true", help="run plain HF for comparison")
    gen.add_argument("--dsinfer", default=None,
                     help="DSInferConfig fields as a JSON object, e.g. '{\"quant\": {\"bits\": 8}}'")
    gen.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    gen.add_argument("--quant", choices=list(QUANT_FLAGS), default=None,
                     help="quantization of the decoder blocks' weights (int4-a8: 4-bit weights "
                          "and 8-bit activations)")
    gen.add_argument("--compile", action="store_true",
                     help="static KV cache + compiled decode step (first call compiles)")
    gen.set_defaults(func=cmd_generate)
    exp = sub.add_parser("explain", help="show what hf_dsinfer replaces in a model")
    exp.add_argument("--model", default=None)
    exp.add_argument("--dtype", default="float32")
    exp.set_defaults(func=cmd_explain)
    from hf_dsinfer.benchmark import build_parser as bench_parser

    bench = sub.add_parser("bench", help="decode benchmark: HF vs hf_dsinfer bf16/int8/int4")
    bench_parser(bench)
    bench.set_defaults(func=cmd_bench)
    from hf_dsinfer.offload.search import add_parser as plan_parser

    plan_parser(sub)  # hf-dsinfer plan: offload policy from the cost model + LP
    from hf_dsinfer.serve.cli import add_parser as serve_parser

    serve_parser(sub)  # hf-dsinfer serve: OpenAI-compatible server (docs/serving.md)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
