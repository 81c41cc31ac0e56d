"""MoE layer benchmark: hf_dsinfer's FusedMoE against HF's own experts implementations.

One Mixtral sparse-MoE block (bf16, hidden 1024, 8 experts top-2, intermediate 3584 by default)
is timed at 1, 16, 256 and 2048 tokens with every `experts_implementation` transformers offers on
this device (eager, batched_mm, grouped_mm; deepgemm / sonicmoe are CUDA-only) and with the
FusedMoE installed by hf_dsinfer, all on the same weights, interleaved round by round in one
process, medians. Every output is checked against HF eager first. batched_mm gathers a weight
copy per routed token ([T*k, 2I, H]: 7.5 GB at 256 tokens), so it runs only up to 16 tokens.

Also printed: the expert-parallel all-to-all bytes per token our dispatch + combine send for this
routing at ep_size 2/4/8 (flat and hierarchical with 2 ranks per node), against the minimum
(each token's hidden row sent once to every other rank that holds one of its experts, and one
pre-summed row back).

    python benchmarks/moe.py                  # full shapes
    python benchmarks/moe.py --quick          # hidden 256, intermediate 512: seconds
    python benchmarks/moe.py --threads 1      # fewer threads: steadier on a shared machine
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from transformers import MixtralConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from hf_dsinfer.hardware import read_bandwidth
from hf_dsinfer.injection.moe import FusedMoE, resolve_moe_spec
from hf_dsinfer.injection.policies import mixtral
from hf_dsinfer.parallel.expert import ExpertPlacement, a2a_bytes_per_token

CUDA_ONLY = {"deepgemm", "sonicmoe"}
BATCHED_MM_MAX_TOKENS = 16


def build_block(hidden: int, inter: int, experts: int, top_k: int) -> MixtralSparseMoeBlock:
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                           num_local_experts=experts, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def fused_moe(block: MixtralSparseMoeBlock):
    """FusedMoE over the block, as a provider. The HF providers switch the block's experts
    implementation; FusedMoE hands a block whose implementation changed after injection back to
    HF (FusedMoE.deferred_why), so before each call the provider restores the implementation it
    was built with. Without that this row timed HF's last implementation, not FusedMoE."""
    owner = types.SimpleNamespace(enabled=True, policy=mixtral.POLICY)  # what a FusedBlock gives
    layout = mixtral.POLICY.moe
    spec = resolve_moe_spec(block, layout, block.experts.config, "silu", None)
    fused = FusedMoE(block, layout, spec, "auto", owner)

    def call(x):
        block.experts.config._experts_implementation = fused.experts_implementation
        assert fused.deferred_why is None
        return fused(x)

    call.fused = fused
    return call


def hf_providers(block: MixtralSparseMoeBlock, tokens: int) -> dict:
    names = ["eager", *(n for n in ALL_EXPERTS_FUNCTIONS if n not in CUDA_ONLY)]
    if tokens > BATCHED_MM_MAX_TOKENS:
        names.remove("batched_mm")

    def run(name):
        def call(x):
            block.experts.config._experts_implementation = name
            return block(x)
        return call

    return {f"HF {n}": run(n) for n in names}


def time_interleaved(providers: dict, x: torch.Tensor, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in providers}
    for fn in providers.values():
        fn(x)  # warm-up
    for _ in range(reps):
        for name, fn in providers.items():
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def active_weight_bytes(block: MixtralSparseMoeBlock, x: torch.Tensor) -> int:
    _, _, ids = block.gate(x.view(-1, x.shape[-1]))
    per_expert = block.experts.gate_up_proj[0].nbytes + block.experts.down_proj[0].nbytes
    return len(torch.unique(ids)) * per_expert


@torch.no_grad()
def layer_table(block, tokens_list, reps: int, bandwidth: float) -> list[str]:
    ours = fused_moe(block)
    rows = ["| tokens | provider | time (ms) | weights read GB/s | of peak read | fused speedup |",
            "| --- | --- | --- | --- | --- | --- |"]
    for tokens in tokens_list:
        x = torch.randn(1, tokens, block.gate.hidden_dim, dtype=torch.bfloat16)
        providers = {**hf_providers(block, tokens), "hf_dsinfer FusedMoE": ours}
        expected = providers["HF eager"](x).float()
        for name, fn in providers.items():
            err = (fn(x).float() - expected).norm() / expected.norm()
            assert err < 2e-2, f"{name} at {tokens} tokens: rel err {err:.2e} vs HF eager"
        times = time_interleaved(providers, x, reps if tokens < 1024 else max(3, reps // 3))
        best_hf = min(t for n, t in times.items() if n.startswith("HF"))
        gbytes = active_weight_bytes(block, x) / 1e9
        for name, t in times.items():
            speed = f"**{best_hf / t:.2f}x** vs best HF" if name.startswith("hf_dsinfer") else (
                f"{best_hf / t:.2f}x (best HF)" if t == best_hf else f"{best_hf / t:.2f}x")
            rows.append(f"| {tokens} | {name} | {t * 1e3:.1f} | {gbytes / t:.1f} | "
                        f"{gbytes / t / bandwidth:.0%} | {speed} |")
    return rows


@torch.no_grad()
def a2a_table(block, tokens: int, hidden: int) -> list[str]:
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    _, _, ids = block.gate(x)
    experts = block.experts.gate_up_proj.shape[0]
    rows = ["| ep_size | all-to-all | bytes / token (ours) | minimum | ratio |",
            "| --- | --- | --- | --- | --- |"]
    for ep in (2, 4, 8):
        for node in (None, 2):
            if node is not None and node >= ep:
                continue
            placement = ExpertPlacement(experts, ep, rank=0)
            ours, minimum = a2a_bytes_per_token(placement, ids, hidden, 2, node)
            kind = "flat" if node is None else f"hierarchical, {node} ranks/node"
            rows.append(f"| {ep} | {kind} | {ours:.0f} | {minimum:.0f} | {ours / minimum:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 256, 2048])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter = (256, 512) if args.quick else (1024, 3584)
    block = build_block(hidden, inter, 8, 2)
    bandwidth = read_bandwidth()
    print(f"MoE layer: bf16, hidden {hidden}, 8 experts top-2, intermediate {inter}, "
          f"{torch.get_num_threads()} threads, memory read {bandwidth:.1f} GB/s\n")
    print("\n".join(layer_table(block, args.tokens, args.reps, bandwidth)))
    print(f"\nExpert-parallel all-to-all (dispatch + combine), {args.tokens[-1]} tokens, "
          "bf16 rows:\n")
    print("\n".join(a2a_table(block, args.tokens[-1], hidden)))


if __name__ == "__main__":
    main()
