"""Bytes all-reduced per generated token per layer under tensor parallelism, vs Megatron.

    torchrun --nproc-per-node 2 benchmarks/tp_comm.py [--batch 1 4] [--dtype float32 bfloat16]

Megatron-style slicing needs two all-reduces of the hidden state per layer and token (after
attention's and after the MLP's row-parallel projection): 2 x batch x hidden x dtype bytes.
This script counts what actually goes through torch.distributed: `all_reduce` and
`all_gather` are wrapped, and a forward hook on every decoder block says whether a collective
ran inside a block (per-layer traffic) or outside (the vocab-parallel embedding's all-reduce and
lm_head's all-gather, once per token). Parallel-residual layouts (GPT-NeoX's
use_parallel_residual, GPT-J) add the attention and MLP partial sums before one all-reduce, so
their ratio is 0.5. Before counting, the tensor-parallel logits are checked against the same
model run whole in one process. Prints a Markdown table (rank 0).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

# The tiny models live in tests/.
sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import FAMILIES, make_model  # tiny random HF models, one per family

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report


class CollectiveCounter:
    """Wraps torch.distributed.all_reduce / all_gather; counts bytes sent into each, by place."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.inside_block = False
        self.active = False
        self._saved = (dist.all_reduce, dist.all_gather)

    def install(self) -> None:
        all_reduce, all_gather = self._saved

        def counted_all_reduce(tensor, *args, **kwargs):
            self._count("all_reduce", tensor)
            return all_reduce(tensor, *args, **kwargs)

        def counted_all_gather(outputs, tensor, *args, **kwargs):
            self._count("all_gather", tensor)
            return all_gather(outputs, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather

    def remove(self) -> None:
        dist.all_reduce, dist.all_gather = self._saved

    def _count(self, op: str, tensor: torch.Tensor) -> None:
        if self.active:
            where = f"{op}:{'block' if self.inside_block else 'outside'}"
            self.bytes[where] += tensor.numel() * tensor.element_size()
            self.calls[where] += 1


def _hook_blocks(model, counter: CollectiveCounter) -> list:
    handles = []
    for fused in get_report(model).blocks.values():
        def enter(*_args, **_kwargs):
            counter.inside_block = True

        def leave(*_args, **_kwargs):
            counter.inside_block = False

        handles.append(fused.block.register_forward_pre_hook(enter))
        handles.append(fused.block.register_forward_hook(leave))
    return handles


def measure(name: str, batch: int, dtype: torch.dtype, tp: int) -> dict:
    ref = make_model(name, dtype=dtype)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref), tp_size=tp)
    ids = torch.randint(3, ref.config.vocab_size, (batch, 9), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits.float(), model(ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * want.abs().max().item()
    assert (want - got).abs().max().item() <= tol, f"{name}: tensor-parallel logits differ"
    counter = CollectiveCounter()
    handles = _hook_blocks(model, counter)
    counter.install()
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)  # prefill, not counted
            counter.active = True
            model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)  # one token
    finally:
        counter.remove()
        for handle in handles:
            handle.remove()
    report = get_report(model)
    layers = len(report.blocks)
    hidden = ref.config.hidden_size
    element = torch.empty((), dtype=dtype).element_size()
    minimum = 2 * batch * hidden * element
    per_layer = counter.bytes["all_reduce:block"] / layers
    return {
        "family": name, "layout": next(iter(report.blocks.values())).spec.layout, "batch": batch,
        "dtype": str(dtype).removeprefix("torch."), "layers": layers,
        "reduces": counter.calls["all_reduce:block"] / layers, "per_layer": per_layer,
        "minimum": minimum, "ratio": per_layer / minimum,
        "embed": counter.bytes["all_reduce:outside"], "head": counter.bytes["all_gather:outside"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    rows = [measure(name, batch, getattr(torch, dtype), tp)
            for name in args.families for dtype in args.dtype for batch in args.batch]
    if dist.get_rank() == 0:
        print(f"tp_size={tp}: bytes entering all_reduce per generated token (one decode step)\n")
        print("| family | layout | batch | dtype | all-reduces / layer | bytes / layer | "
              "Megatron min 2*B*H*bytes | ratio | embedding all-reduce B | lm_head all-gather B |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['family']} | {r['layout']} | {r['batch']} | {r['dtype']} | "
                  f"{r['reduces']:.0f} | {r['per_layer']:.0f} | {r['minimum']} | "
                  f"{r['ratio']:.2f} | {r['embed']} | {r['head']} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
