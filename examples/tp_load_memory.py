"""Peak resident memory per rank when loading a checkpoint with tensor parallelism.

    python examples/tp_load_memory.py make /tmp/llama-1g            # random ~1 GB Llama (fp32)
    python examples/tp_load_memory.py load /tmp/llama-1g            # single process, tp=1
    torchrun --nproc-per-node 2 examples/tp_load_memory.py load /tmp/llama-1g   # tp=2
    torchrun --nproc-per-node 2 examples/tp_load_memory.py load /tmp/llama-1g --pp 2  # 2 stages

`load` prints, per rank, the resident memory before loading (interpreter + torch +
transformers), the peak (ru_maxrss) over loading and one forward pass (a single process's
transformers loader leaves weights as views of the mapped file, resident only once read), and
the bytes of parameters this rank holds.
With sharded loading each rank reads only its slices from the safetensors file, so its peak
tracks its shard instead of the whole checkpoint.
"""

from __future__ import annotations

import argparse
import os
import resource

import torch


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make(folder: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    # 16 layers of hidden 1024 / MLP 2816 plus a 32k vocabulary, untied: ~270 M params, ~1.08 GB
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"saved {folder}: {size / 1e9:.2f} GB")


def load(folder: str, parity_check: bool, pp: int) -> None:
    from transformers import AutoModelForCausalLM

    import hf_dsinfer  # noqa: F401  (registers dsinfer=)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    before = rss_mb()
    model = AutoModelForCausalLM.from_pretrained(folder, dsinfer={
        "tp_size": world // pp, "pp_size": pp, "parity_check": parity_check})
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    # One forward: weights that the loader left as views of the mapped file (transformers does,
    # for a single process) only become resident when they are first read.
    with torch.no_grad():
        model(torch.arange(8).view(1, 8))
    peak = peak_mb()
    print(f"| {world // pp} x {pp} | {parity_check} | {rank} | {before:.0f} | {peak:.0f} | "
          f"{peak - before:.0f} | {held:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["make", "load"])
    parser.add_argument("folder")
    parser.add_argument("--no-parity", action="store_true",
                        help="skip the parity gate (under tp>1 it reads one full block per class)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (world = tp * pp)")
    args = parser.parse_args()
    if args.action == "make":
        make(args.folder)
    else:
        if os.environ.get("RANK", "0") == "0":
            print("| tp x pp | parity gate | rank | RSS before load (MiB) | peak RSS (MiB) | "
                  "peak - before (MiB) | parameters held (MiB) |\n|---|---|---|---|---|---|---|",
                  flush=True)
        load(args.folder, not args.no_parity, args.pp)


if __name__ == "__main__":
    main()
