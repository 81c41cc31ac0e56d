"""Decode benchmark behind `hf-dsinfer bench` and `benchmarks/decode.py`.

One process, configurations interleaved and repeated, medians reported:
    hf          HF eager (the reference)
    hf-fp32     HF eager on an fp32 copy: on CPUs whose bf16 one-row GEMMs are slow (no native
                bf16 dot products, or oneDNN's AVX-512 bf16 GEMV on Zen 4) HF's faster dtype
    hf-compile  HF's own static cache + torch.compile'd decode step
    bf16        hf_dsinfer fused blocks, model dtype
    bf16-compile  fused blocks + static cache + compiled decode step
    bf16-static fused blocks + HF's preallocated static cache, eager decode step
    int8 / int4 fused blocks with weight-only int8 / int4 (group-wise) linears (-compile: plus
                static cache and compiled decode step)
    llama.cpp Q4_1  peer row for `--models smollm2` at batch 1 when llama-cpp-python is
                installed: the same GGUF file in the CPU engine users pick instead
Models are random-weight, shaped like Llama-1.1B (TinyLlama), OPT-1.3B, Qwen3-0.6B and
Gemma-3-1B (text), or the embedded
SmolLM2-135M-Instruct (real weights, `smollm2`). Prompts are random tokens for the random
models, and English text for SmolLM2 (on random tokens a real model's top logits tie in bf16, so
greedy tokens there compare roundings, not paths). Before timing, each
configuration's first greedy tokens are compared with HF eager. Printed per row: prefill ms,
decode tok/s (all sequences), speed-up over HF eager, the weight bytes read per decode step as
GB/s and as a fraction of the memory-read bandwidth measured in the same run, and the model's
resident size. A PNG bar chart of decode tok/s is written next to the table.

Every run generates exactly N tokens by generating with no end-of-sequence token (GEN_FIXED),
as the llama.cpp peer's loop does and as serving benchmarks ignore EOS. It does not use
`min_new_tokens`: that adds two logits processors to HF's loop, each comparing the whole
vocabulary with the EOS ids at every step (SmolLM2: ~1 ms of a ~9 ms step on a 2-core Zen 4,
2026-11-27). A user who does not ask for a minimum length does not pay that, and the peer
does not pay it either.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import importlib.util
import os
import resource
import statistics
import time

import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    OPTConfig,
    Qwen3Config,
    Starcoder2Config,
)

from hf_dsinfer import settings
from hf_dsinfer.api import init_inference
from hf_dsinfer.hardware import read_bandwidth
from hf_dsinfer.injection.latency import compile_config

MODELS = {
    "llama-1.1b": lambda: LlamaConfig(hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=22, num_attention_heads=32,
                                      num_key_value_heads=4, vocab_size=32000),
    "opt-1.3b": lambda: OPTConfig(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                                  num_attention_heads=32, vocab_size=50272,
                                  word_embed_proj_dim=2048, max_position_embeddings=2048),
    "qwen3-0.6b": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072,
                                      num_hidden_layers=28, num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      tie_word_embeddings=True, max_position_embeddings=40960,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1e6}),
    "gemma3-1b": lambda: Gemma3TextConfig(hidden_size=1152, intermediate_size=6912,
                                          num_hidden_layers=26, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=256,
                                          vocab_size=262144, sliding_window=512,
                                          query_pre_attn_scalar=256,
                                          max_position_embeddings=32768),
    # StarCoder2-3B's shape: LayerNorms, a biased tanh-GELU MLP, biases on every projection
    "starcoder2-3b": lambda: Starcoder2Config(hidden_size=3072, intermediate_size=12288,
                                              num_hidden_layers=30, num_attention_heads=24,
                                              num_key_value_heads=2, vocab_size=49152,
                                              sliding_window=4096, use_bias=True,
                                              max_position_embeddings=16384, bos_token_id=0,
                                              eos_token_id=0),
    # the issue-27 MoE families, scaled down (the real ones are 21B / 671B parameters): each
    # family's block and routing at ~0.4-0.5B parameters
    "gpt-oss-mini": lambda: GptOssConfig(hidden_size=1024, intermediate_size=1024,
                                         num_hidden_layers=8, num_attention_heads=16,
                                         num_key_value_heads=4, head_dim=64,
                                         num_local_experts=16, num_experts_per_tok=4,
                                         sliding_window=128, vocab_size=32000),
    "deepseek-v3-mini": lambda: DeepseekV3Config(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
        kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=1, vocab_size=32000),
    "tiny": lambda: LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "smollm2": None,  # the embedded SmolLM2-135M-Instruct GGUF (real weights), see default_model.load
}
CONFIGS = {
    "hf": None,
    "hf-fp32": None,
    "hf-compile": None,
    "bf16": {},
    "bf16-compile": {"compile": True},
    "bf16-static": {"cache": "static"},
    "int8": {"quant": {"bits": 8}},
    "int8-compile": {"quant": {"bits": 8}, "compile": True},
    "int4": {"quant": {"bits": 4}},
    "int4-compile": {"quant": {"bits": 4}, "compile": True},
    "int4-a8": {"quant": {"bits": 4, "act_bits": 8}},
}


@dataclasses.dataclass
class Row:
    model: str
    batch: int
    config: str
    weight_bytes: int  # the model's footprint without the input-embedding table
    read_bytes: int  # of those, the bytes one decode step reads (see _read_bytes)
    prefill: list[float] = dataclasses.field(default_factory=list)
    decode: list[float] = dataclasses.field(default_factory=list)  # seconds per decode step
    match: str = "-"
    first_call: float = float("nan")  # seconds of the first (warm-up, compiling) generate


def _weight_bytes(model) -> int:
    """Every parameter/buffer but the input-embedding table (an untied one is not read by a
    decode step)."""
    total = model.get_memory_footprint()
    emb = model.get_input_embeddings().weight
    tied = emb is getattr(model.get_output_embeddings(), "weight", None)
    return total if tied else total - emb.numel() * emb.element_size()


# An int4 linear whose codes are not tiles (where the native kernels do not run, or the shape is
# not whole tiles) also keeps torch's int4 layout for 2-32 rows (kernels/quant.py); a step reads
# one of the two copies. Tiled weights keep one copy: the native kernel reads it for 1-32 rows.
_SECOND_INT4_COPY = ("cpu_packed", "cpu_scales_zeros")


def _read_bytes(model) -> int:
    """Bytes one decode step reads: _weight_bytes less the int4 copy it does not read."""
    second = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                 if name.rsplit(".", 1)[-1] in _SECOND_INT4_COPY)
    return _weight_bytes(model) - second


def base_model(name: str, dtype: torch.dtype):
    if MODELS[name] is None:
        from hf_dsinfer.default_model import load

        return load(None, False, dtype)[0]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MODELS[name](), dtype=dtype).eval()


# the real model's prompt: plain prose, repeated to the prompt length
PROSE = ("The harbor was quiet in the early morning. Fishing boats rocked against the pier while "
         "gulls circled above the market, where traders set out crates of fruit, bread and "
         "cheese. A small girl asked her grandfather why the tide came in twice a day, and he "
         "explained, as well as he could, how the moon pulls on the oceans of the earth.")


def prompt_ids(name: str, vocab: int, batch: int, length: int) -> torch.Tensor:
    """[batch, length] prompt ids: random for the random-weight models; for the real model
    (smollm2) PROSE tokenized and repeated, each row from another starting token."""
    if MODELS[name] is not None:
        return torch.randint(3, vocab, (batch, length),
                             generator=torch.Generator().manual_seed(batch))
    text = _prose_tokens()
    stream = text * ((length + 7 * batch) // len(text) + 1)
    return torch.tensor([stream[7 * b: 7 * b + length] for b in range(batch)])


@functools.cache
def _prose_tokens() -> list[int]:
    """PROSE in the embedded model's tokens (its tokenizer read once per process)."""
    from hf_dsinfer.default_model import load_tokenizer

    tokenizer = load_tokenizer()
    return tokenizer(PROSE, add_special_tokens=False)["input_ids"]


def labels(configs: list[str], isa: list[str] | None) -> list[str]:
    """The rows' configurations: each hf_dsinfer one once per ISA tier named (`int4@avx2`), or
    once at the CPU's own tier; HF's as they are."""
    out = []
    for config in configs:
        tiers = isa if isa and CONFIGS[config] is not None else [None]
        out += [config if tier is None else f"{config}@{tier}" for tier in tiers]
    return out


def build_variants(name: str, configs: list[str], dtype: torch.dtype) -> dict:
    """One model per label of `labels`: HF's base model, or an injected copy (carrying its ISA
    tier as its own settings, so it runs that tier's kernels in every call)."""
    base = base_model(name, dtype)
    variants = {}
    for label in configs:
        config, _, tier = label.partition("@")
        if config == "hf-fp32":
            variants[label] = copy.deepcopy(base).float()
        elif CONFIGS[config] is None:
            variants[label] = base
        else:
            extra = {"settings": {"isa": tier}} if tier else {}
            variants[label] = init_inference(copy.deepcopy(base), parity_check=False,
                                             **CONFIGS[config], **extra)
    return variants


# generate exactly max_new_tokens: no end-of-sequence token stops the run (module docstring)
GEN_FIXED = {"eos_token_id": None, "do_sample": False, "pad_token_id": 0}


def _generate(model, config: str, ids, new_tokens: int, clock: StepClock | None = None):
    kwargs = {"max_new_tokens": new_tokens, **GEN_FIXED}
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    if config == "hf-compile":
        kwargs.update(cache_implementation="static", compile_config=compile_config())
    elif config in ("hf", "hf-fp32"):
        kwargs.update(disable_compile=True)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
    return out, time.perf_counter() - start


class StepClock(LogitsProcessor):
    """The time of each generated token: generate calls its logits processors once per token,
    right after that step's forward. Changes no score."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def measure(model, config: str, ids, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step): the prefill from a 1-token generate, the
    steps from the clock of an N-token one (first token to last over N - 1 steps), as the
    llama.cpp peer times its loop. The difference of the two generates' times, used before,
    carried both prefills' noise: with a 1536-token prompt (~3 s prefill, ~0.4 s of decode)
    it moved the decode rate by up to 2x between repeats."""
    _, t1 = _generate(model, config, ids, 1)
    clock = StepClock()
    _generate(model, config, ids, new_tokens, clock)
    if len(clock.stamps) != new_tokens:
        raise RuntimeError(f"bench: expected {new_tokens} generated tokens, the clock saw "
                           f"{len(clock.stamps)}; generate stopped early or skipped the "
                           "logits processors")
    return t1, (clock.stamps[-1] - clock.stamps[0]) / (new_tokens - 1)


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) decoding the same SmolLM2 Q4_1 GGUF file: the CPU engine users
    pick instead. Greedy (argmax) loop over `Llama.eval`, timed like `measure`."""

    config = "llama.cpp Q4_1"

    def __init__(self, threads: int, tokens: int = 1024):
        """tokens: the most positions a run holds (prompt plus new tokens): the context llama.cpp
        allocates; a fixed 1024 made every longer prompt fail in `llama_decode`."""
        from llama_cpp import Llama

        from hf_dsinfer.default_model import DEFAULT_GGUF, default_model_dir

        self.path = default_model_dir() / DEFAULT_GGUF
        self.llm = Llama(model_path=str(self.path), n_ctx=max(tokens, 512), n_batch=512,
                         n_threads=threads, verbose=False)

    @staticmethod
    def available(name: str, batch: int) -> bool:
        return name == "smollm2" and batch == 1 and importlib.util.find_spec("llama_cpp") is not None

    def generate(self, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
        """(new tokens [1, N], prefill seconds, seconds per decode step)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids[0].tolist())
        prefill = time.perf_counter() - start
        tokens = [self._argmax()]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(self._argmax())
        step = (time.perf_counter() - start) / (new_tokens - 1)
        return torch.tensor([tokens]), prefill, step

    def _argmax(self) -> int:
        """The greedy next token after the last one evaluated, from llama.cpp's own logits.
        `Llama.scores` is not filled without logits_all (llama-cpp-python 0.3 samples inside
        llama.cpp), so reading it took the argmax of an uninitialized array: the peer's tokens
        were meaningless (its speed was not, a step costs the same whatever the token)."""
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for name in args.models:
        variants = build_variants(name, args.configs, torch.bfloat16)
        vocab = variants["hf"].config.vocab_size if "hf" in variants else 1000
        for batch in args.batch:
            ids = prompt_ids(name, vocab, batch, args.prompt_len)
            group = [Row(name, batch, c, _weight_bytes(variants[c]), _read_bytes(variants[c]))
                     for c in args.configs]
            peer = _peer(args, name, batch, group)
            _check_tokens(variants, group, ids, args.new_tokens, peer)
            for _ in tqdm(range(args.repeats), desc=f"{name} batch {batch}", leave=False):
                for row in group:  # interleaved: every config once per repeat
                    if row.config == LlamaCppPeer.config:
                        _, prefill, step = peer.generate(ids, args.new_tokens)
                    else:
                        prefill, step = measure(variants[row.config], row.config, ids,
                                                args.new_tokens)
                    row.prefill.append(prefill)
                    row.decode.append(step)
            rows.extend(group)
        # injected models hold reference cycles: without a collection here, each model's
        # configurations stayed alive while the next model's were built (an AMX Xeon with
        # 24 GiB was OOM-killed at the third model of three, 2026-11-28)
        del variants
        gc.collect()
    return rows


def _peer(args: argparse.Namespace, name: str, batch: int, group: list[Row]):
    """The optional llama.cpp row (SmolLM2, batch 1, when llama-cpp-python is installed)."""
    if args.no_peer or not LlamaCppPeer.available(name, batch):
        return None
    peer = LlamaCppPeer(torch.get_num_threads(), args.prompt_len + args.new_tokens)
    size = peer.path.stat().st_size
    group.append(Row(name, batch, LlamaCppPeer.config, size, size))
    return peer


def _check_tokens(variants: dict, group: list[Row], ids, new_tokens: int, peer=None) -> None:
    """Warm every config (compiles included) and compare its greedy tokens with HF eager."""
    ref = None
    for row in group:
        if row.config == LlamaCppPeer.config:
            start = time.perf_counter()
            tokens = peer.generate(ids, new_tokens)[0]
            seconds = time.perf_counter() - start
        else:
            out, seconds = _generate(variants[row.config], row.config, ids, new_tokens)
            tokens = out[:, ids.shape[1]:]
        if ref is None:
            ref = tokens
        agree = (tokens == ref).float().mean().item()
        row.match = f"{agree:.0%}"
        row.first_call = seconds  # warm-up (compile) cost, reported honestly


def format_table(rows: list[Row], bandwidth: float) -> str:
    lines = [f"memory-read bandwidth measured in this run: {bandwidth:.1f} GB/s", "",
             ("| model | batch | config | prefill ms | decode tok/s | vs HF eager | GB/s | "
              "% of read bw | model MB | first call s | greedy = HF |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for row in rows:
        step = statistics.median(row.decode)
        tok_s = row.batch / step
        if row.config == "hf":
            base[(row.model, row.batch)] = tok_s
        ratio = tok_s / base.get((row.model, row.batch), tok_s)
        gbs = row.read_bytes / step / 1e9
        lines.append(
            f"| {row.model} | {row.batch} | {row.config} | "
            f"{statistics.median(row.prefill) * 1e3:.0f} | {tok_s:.2f} | {ratio:.2f}x | "
            f"{gbs:.1f} | {gbs / bandwidth:.0%} | {row.weight_bytes / 2**20:.0f} | "
            f"{row.first_call:.1f} | {row.match} |")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lines.append(f"\nprocess peak RSS (all configurations live at once): {peak:.2f} GiB")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.model}\nb{r.batch} {r.config}" for r in rows]
    values = [r.batch / statistics.median(r.decode) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(range(len(rows)), values, color=["grey" if r.config.startswith("hf") else "tab:blue"
                                            for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode throughput, median of interleaved repeats", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama-1.1b", "opt-1.3b"],
                        choices=list(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default="decode_bench.png")
    parser.add_argument("--isa", nargs="+", choices=list(settings.TIERS), default=None,
                        help="run each hf_dsinfer configuration once per ISA tier named (rows "
                             "like int4@avx2, side by side in one process); only tiers this CPU "
                             "has (kernels/_native.py)")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave out the llama.cpp row (shown for smollm2 when installed)")
    return parser


def separate_inductor_cache(environ=os.environ) -> str | None:
    """Under ATEN_CPU_CAPABILITY (the AVX2 imitation in docs/cpu_kernels.md), give torch
    inductor a cache directory of that capability's own, unless one is named (bench and the
    test suite both call this). torch 2.13's FX graph cache does not key on the variable: kernels
    compiled uncapped made a capped run's compiled functions return NaN, and a graph compiled
    capped, loaded by an uncapped run, corrupted the heap (`free(): invalid pointer`; both on a
    Zen 4, 2026-11-27). Returns the directory set, or None.
    Importing torch._dynamo (which `import hf_dsinfer` does) writes torch's default directory
    into TORCHINDUCTOR_CACHE_DIR, so that value counts as not named: taking it for the user's
    choice made this a no-op, and a capped suite shared the uncapped cache again (2026-11-28)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = environ.get("ATEN_CPU_CAPABILITY")
    if not capability or environ.get("TORCHINDUCTOR_CACHE_DIR") not in (None, "",
                                                                         default_cache_dir()):
        return None

    environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(),
                                                      f"aten-cpu-{capability.lower()}")
    return environ["TORCHINDUCTOR_CACHE_DIR"]


def main(args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args()
    separate_inductor_cache()
    if args.configs[0] != "hf":
        args.configs = ["hf", *[c for c in args.configs if c != "hf"]]
    if args.isa:
        from hf_dsinfer.kernels import _native

        if lacking := [t for t in args.isa if t not in _native.runnable_tiers()]:
            raise SystemExit(f"--isa {' '.join(lacking)}: this CPU (or its compiler) lacks "
                             f"{'that tier' if len(lacking) == 1 else 'those tiers'}; it runs "
                             f"{', '.join(_native.runnable_tiers())}. Fix: name those.")
    args.configs = labels(args.configs, args.isa)
    bandwidth = read_bandwidth("cpu")
    rows = run(args)
    print(format_table(rows, bandwidth))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0
