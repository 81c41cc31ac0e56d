"""Generate text with a tensor-parallel model, launched by torchrun or accelerate launch.

    torchrun --nproc-per-node 2 examples/tp_generate.py --model ./my-model "Hello"
    accelerate launch --config_file examples/accelerate/tp2_one_node.yaml examples/tp_generate.py
    python examples/tp_generate.py --tp-size 1          # the single-process reference

Every rank loads only its slices of the checkpoint (safetensors; a GGUF file such as the
embedded default SmolLM2-135M-Instruct is loaded whole and sliced), runs the same generate()
call, and gets the same tokens; rank 0 prints the new text. tp_size defaults to the number of
launched processes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def load(model: str | None, tp_size: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_dsinfer  # noqa: F401  (registers dsinfer=)
    from hf_dsinfer.default_model import DEFAULT_GGUF, default_model_dir

    path, extra = (model, {}) if model else (default_model_dir(), {"gguf_file": DEFAULT_GGUF})
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              dsinfer={"tp_size": tp_size}, **extra)
    return lm, tokenizer


def inputs_for(tokenizer, prompt: str) -> dict:
    """The chat template when the tokenizer has one, as `hf-dsinfer generate` does."""
    from hf_dsinfer.default_model import chat_inputs

    return chat_inputs(tokenizer, prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M)")
    parser.add_argument("--tp-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.tp_size)))
    model, tokenizer = load(args.model, args.tp_size)
    inputs = inputs_for(tokenizer, args.prompt)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    print(f"[rank {rank} of {world}] tp_size={args.tp_size}: {text!r}", file=sys.stderr, flush=True)
    if rank == 0:
        print(text, flush=True)


if __name__ == "__main__":
    main()
