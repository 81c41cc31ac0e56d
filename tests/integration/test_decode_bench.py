"""`hf-dsinfer bench` / benchmarks/decode.py end to end on the tiny model: the table, the plot,
and the bytes a decode step reads (an int4 model's second copy of its codes, torch's layout for
2-32 rows, is in its footprint but not in what a step reads)."""

from __future__ import annotations

import pytest
import torch

import hf_dsinfer
from hf_dsinfer import benchmark


def test_bench_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    args = benchmark.build_parser().parse_args(
        ["--models", "tiny", "--batch", "1", "2", "--configs", "hf", "hf-fp32", "bf16", "int4",
         "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1",
         "--plot", str(tmp_path / "bench.png")])
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    assert "memory-read bandwidth measured in this run" in out
    for config in ("hf", "hf-fp32", "bf16", "int4"):
        for batch in (1, 2):
            assert f"| tiny | {batch} | {config} |" in out
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_read_bytes_count_one_copy_of_int4_codes():
    model = hf_dsinfer.init_inference(benchmark.base_model("tiny", torch.bfloat16),
                                      parity_check=False, quant={"bits": 4})
    second = sum(b.numel() for name, b in model.named_buffers()
                 if name.endswith((".cpu_packed", ".cpu_scales_zeros")))
    if second == 0:  # no torch int4 layout on this build: one copy already
        assert benchmark._read_bytes(model) == benchmark._weight_bytes(model)
        return
    assert benchmark._read_bytes(model) < benchmark._weight_bytes(model)
    packed = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                 if name.endswith(".packed"))
    assert benchmark._read_bytes(model) >= packed


def test_bench_runs_each_config_at_each_tier_named(monkeypatch, capsys):
    """--isa: a row per hf_dsinfer configuration and tier, side by side in one process; each
    model carries its tier (its own settings), so the kernels it calls are that tier's."""
    from hf_dsinfer.kernels import _native

    tiers = sorted({"generic", _native.cpu_tier()}, key=_native.TIERS.index)
    seen, real = [], _native.lib
    monkeypatch.setattr(_native, "lib",
                        lambda use="kernels": seen.append(_native.tier()) or real(use))
    args = benchmark.build_parser().parse_args(
        ["--models", "tiny", "--batch", "1", "--configs", "hf", "int8", "--isa", *tiers,
         "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1", "--plot", ""])
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    assert "| tiny | 1 | hf |" in out and "| tiny | 1 | hf@" not in out
    for tier in tiers:
        assert f"| tiny | 1 | int8@{tier} |" in out
    assert set(tiers) <= set(seen), seen


def test_prompts_are_random_for_random_models_and_prose_for_the_real_one():
    """Random tokens would make the real model's greedy comparison one of tied logits."""
    random = benchmark.prompt_ids("tiny", 100, 2, 8)
    assert random.shape == (2, 8) and int(random.min()) >= 3 and int(random.max()) < 100
    assert torch.equal(random, benchmark.prompt_ids("tiny", 100, 2, 8))  # seeded
    from hf_dsinfer.default_model import load_tokenizer

    ids = benchmark.prompt_ids("smollm2", 0, 2, 90)  # longer than PROSE: repeated
    assert ids.shape == (2, 90) and not torch.equal(ids[0], ids[1])
    tokenizer = load_tokenizer()
    assert tokenizer.decode(ids[0]).startswith("The harbor was quiet")
    assert tokenizer.decode(ids[0]).count("The harbor was quiet") == 2


def test_bench_refuses_a_tier_the_cpu_lacks(monkeypatch):
    from hf_dsinfer.kernels import _native

    monkeypatch.setattr(_native, "runnable_tiers", lambda: ("generic", "avx2"))
    args = benchmark.build_parser().parse_args(["--models", "tiny", "--isa", "avx2", "amx"])
    with pytest.raises(SystemExit, match="--isa amx: this CPU .* lacks that tier; it runs "
                                         "generic, avx2. Fix"):
        benchmark.main(args)


def test_inductor_cache_apart_per_aten_capability(monkeypatch):
    """A graph compiled under ATEN_CPU_CAPABILITY=avx2 and loaded from torch's cache by a
    process without it corrupted the heap: bench keeps each capability's cache apart, and
    leaves a named cache directory, or none asked for, alone."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from hf_dsinfer.benchmark import separate_inductor_cache

    env = {"ATEN_CPU_CAPABILITY": "AVX2"}
    assert separate_inductor_cache(env) == env["TORCHINDUCTOR_CACHE_DIR"]
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(default_cache_dir())
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("aten-cpu-avx2")
    named = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/somewhere"}
    assert separate_inductor_cache(named) is None and named["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
    plain: dict = {}
    assert separate_inductor_cache(plain) is None and plain == {}
    # torch's own default, which importing torch._dynamo writes there, is not a named directory
    torchs = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    assert separate_inductor_cache(torchs) == torchs["TORCHINDUCTOR_CACHE_DIR"]
    assert torchs["TORCHINDUCTOR_CACHE_DIR"].endswith("aten-cpu-avx2")


def test_capped_processes_compile_into_their_own_cache():
    """In a process that imported hf_dsinfer (and so torch._dynamo) under ATEN_CPU_CAPABILITY,
    the cache directory in force is the capability's own: the test suite's conftest and bench
    call separate_inductor_cache after that import."""
    import os
    import subprocess
    import sys

    code = ("import os, hf_dsinfer\n"
            "from hf_dsinfer.benchmark import separate_inductor_cache\n"
            "separate_inductor_cache()\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(cache_dir())")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["ATEN_CPU_CAPABILITY"] = "avx2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().endswith("aten-cpu-avx2")


@pytest.mark.parametrize("config", ["hf", "int8"])
def test_runs_generate_every_token_past_eos_without_min_length_processors(config, monkeypatch):
    """N tokens are timed even where the model emits its EOS token early, and HF's loop runs no
    min-length processors (each scans the vocabulary per step), as the peer's loop runs none."""
    from transformers.generation import logits_process

    base = benchmark.base_model("tiny", torch.bfloat16)
    ids = benchmark.prompt_ids("tiny", base.config.vocab_size, 1, 8)
    with torch.inference_mode():
        first = int(base.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    base.generation_config.eos_token_id = first  # the very first new token is EOS
    model = base if config == "hf" else hf_dsinfer.init_inference(
        base, parity_check=False, **benchmark.CONFIGS[config])
    made = []
    for name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
        cls = getattr(logits_process, name)
        monkeypatch.setattr(cls, "__call__", lambda self, i, s, _n=name: made.append(_n) or s)
    out, seconds = benchmark._generate(model, config, ids, 5)
    assert out.shape == (1, ids.shape[1] + 5) and int(out[0, ids.shape[1]]) == first
    assert seconds > 0 and made == []
    with torch.inference_mode():  # and HF's own stop at that EOS, without GEN_FIXED
        stopped = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert stopped.shape == (1, ids.shape[1] + 1)


@pytest.mark.parametrize("config", ["hf", "int8"])
def test_decode_steps_are_timed_apart_from_the_prefill(config, monkeypatch):
    """measure's decode rate is the steps' own clock: a prefill that takes longer in the N-token
    run than in the 1-token run (a long prompt's noise) does not move it, and each step is
    timed, as the llama.cpp peer times its loop."""
    import time

    base = benchmark.base_model("tiny", torch.bfloat16)
    model = base if config == "hf" else hf_dsinfer.init_inference(
        base, parity_check=False, **benchmark.CONFIGS[config])
    ids = benchmark.prompt_ids("tiny", base.config.vocab_size, 1, 8)
    benchmark._generate(model, config, ids, 2)  # warm
    prefills, forward = [], type(model).forward

    def slow_second_prefill(self, *args, **kwargs):
        seq = kwargs.get("input_ids", args[0] if args else None)
        if seq is not None and seq.shape[1] > 1:
            prefills.append(seq.shape[1])
            if len(prefills) == 2:
                time.sleep(0.6)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", slow_second_prefill)
    prefill, step = benchmark.measure(model, config, ids, 5)  # raises unless 5 steps were clocked
    assert prefills == [8, 8]
    assert prefill < 0.6 and 0 < step < 0.1  # the difference of the runs gave >= 0.6 / 4


def test_peer_context_holds_the_whole_run_and_its_tokens_are_llama_cpp_argmax(monkeypatch):
    """The llama.cpp peer allocates a context for the prompt plus the new tokens (with a fixed
    1024, every longer run failed inside `llama_decode` with an error that named nothing), and
    its greedy tokens are the argmax of the logits llama.cpp returns for the last token (not of
    `Llama.scores`, which llama-cpp-python 0.3 leaves unfilled)."""
    import ctypes
    import sys
    import types

    vocab, made, evals = 7, [], []

    class Llama:  # stands in for llama_cpp.Llama (not installed in the test environment)
        def __init__(self, model_path, n_ctx, n_batch, n_threads, verbose):
            made.append(n_ctx)
            self.ctx = object()
            self.scores = [[0.0] * vocab]  # what the old code read: never the right answer

        def n_vocab(self):
            return vocab

        def reset(self):
            evals.clear()

        def eval(self, tokens):
            evals.append(list(tokens))

    def llama_get_logits_ith(ctx, i):  # the last token's logits: peak at (last id + 3) % vocab
        assert i == -1
        row = (ctypes.c_float * vocab)(*[0.0] * vocab)
        row[(evals[-1][-1] + 3) % vocab] = 1.0
        return ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), row

    fake = types.SimpleNamespace(Llama=Llama, rows=[])
    fake.llama_get_logits_ith = lambda ctx, i: fake.rows.append(llama_get_logits_ith(ctx, i)) \
        or fake.rows[-1][0]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(benchmark.LlamaCppPeer, "available", staticmethod(lambda name, batch: True))
    args = benchmark.build_parser().parse_args(
        ["--models", "smollm2", "--batch", "1", "--prompt-len", "1536", "--new-tokens", "32"])
    group = []
    peer = benchmark._peer(args, "smollm2", 1, group)
    assert made == [1568] and peer is not None
    assert group[0].config == benchmark.LlamaCppPeer.config
    tokens, _, _ = peer.generate(torch.tensor([[5, 1]]), 4)
    assert tokens.tolist() == [[4, 0, 3, 6]]  # 1 + 3, 4 + 3 - 7, ...
    assert evals == [[5, 1], [4], [0], [3]]
