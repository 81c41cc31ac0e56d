"""The native decode layer (kernels/decode.py, csrc/cpu_decode.c): batch 1, and batched (bf16
projections on AMX).

It must compute what the torch path of the same fused block computes, in bf16 (its reference:
the torch path is HF's numerics to the bit on these models, see test_family_parity), for every
weight format, cache class and mask, and it must really run (call counters); anything it does
not compute must take the torch path."""

from __future__ import annotations

import pytest
import torch
from switches import switch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Ernie4_5Config,
    GlmConfig,
    GraniteConfig,
    HunYuanDenseV1Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SeedOssConfig,
    SmolLM3Config,
)

import hf_dsinfer
from hf_dsinfer.injection.fused import _norm_eps
from hf_dsinfer.kernels import _native, abi
from hf_dsinfer.kernels import decode as native_decode
from hf_dsinfer.kernels import quant as Q
from hf_dsinfer.kernels.attention import attention_ref
from tests.kernels.conftest import pin_crossovers

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]

VOCAB = 256
_BASE = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "llama": lambda: LlamaConfig(**_BASE),  # head_dim 32, GQA 2
    "llama_d64": lambda: LlamaConfig(**{**_BASE, "num_attention_heads": 2,
                                        "num_key_value_heads": 1}),  # head_dim 64, MQA
    "qwen2": lambda: Qwen2Config(**_BASE),  # q/k/v biases
    # biases on q / k / v and on the MLP's three projections, none on o_proj
    "seed_oss": lambda: SeedOssConfig(**_BASE, head_dim=32, attention_bias=True,
                                      attention_out_bias=False, mlp_bias=True),
    "mistral": lambda: MistralConfig(**_BASE, sliding_window=6),  # window through the mask
    # layer 1 is NoPE: the layer computed without RoPE (kernels.decode rope=False); weights
    # large enough that rotating its q and k would change the logits
    # per-head q/k RMSNorm before RoPE (weights made distinct in _model)
    "qwen3": lambda: Qwen3Config(**_BASE, head_dim=32),
    # branch outputs x 0.4 before each residual add; softmax scale 0.1
    "granite": lambda: GraniteConfig(**_BASE, residual_multiplier=0.4, attention_multiplier=0.1,
                                     embedding_multiplier=2.0, logits_scaling=0.5),
    # fused qkv_proj (GQA) and gate_up_proj, read as row slices
    "phi3": lambda: Phi3Config(**_BASE),
    "smollm3": lambda: SmolLM3Config(**_BASE, no_rope_layer_interval=2, initializer_range=0.1),
    # inputs of 160 and 224 columns: int4 rows end in a partial 128-column chunk
    "llama_odd": lambda: LlamaConfig(**{**_BASE, "hidden_size": 160, "intermediate_size": 224,
                                        "num_attention_heads": 5, "num_key_value_heads": 1}),
    # inputs of 640 and 1024 columns: int4 rows hold whole 512-column runs (the tiles' own
    # column order) and a 128-column rest
    "llama_wide": lambda: LlamaConfig(**{**_BASE, "hidden_size": 640, "intermediate_size": 1024,
                                         "num_attention_heads": 10, "num_key_value_heads": 2}),
    # RoPE over interleaved pairs: in fp32 (ERNIE 4.5's fp32 tables), in bf16 over half of
    # each 64-wide head (GLM, q / k / v biases); q / k norms after RoPE (HunYuan). Weights
    # at 0.1: attention that moves the logits past _batched_against_torch_path's bound when a
    # row rotates by another row's position (checked by hand: every row at row 0's cos / sin)
    "ernie4_5": lambda: Ernie4_5Config(**_BASE, initializer_range=0.1),
    "glm": lambda: GlmConfig(**_BASE, head_dim=64, partial_rotary_factor=0.5,
                             attention_bias=True, initializer_range=0.1),
    "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**_BASE, head_dim=32),
}
QUANTS = {"bf16": None, "int8": {"bits": 8}, "int4": {"bits": 4, "group_size": 32}}


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.bfloat16).eval()
    if name in ("qwen2", "seed_oss", "glm"):  # HF initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         *(getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj",
                                                                 "down_proj"))):
                if proj is not None and proj.bias is not None:
                    torch.nn.init.normal_(proj.bias, std=0.5)
    if name == "qwen3":  # HF initialises the q/k norm weights to ones: make them differ
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
    return model


def _inject(model, quant=None):
    return hf_dsinfer.init_inference(model, dtype=torch.bfloat16, quant=quant)


def _layers(model):
    inner = model.model
    return inner.decoder.layers if hasattr(inner, "decoder") else inner.layers  # OPT: decoder


def _native_calls(model) -> int:
    return sum(layer.forward._decode.calls for layer in _layers(model)
               if layer.forward._decode is not None)


def _row_calls(model) -> int:
    return sum(layer.forward._decode.row_calls for layer in _layers(model)
               if layer.forward._decode is not None)


BATCHED = pytest.mark.skipif(not _native.amx_available(),
                             reason="no AMX-BF16 here: batched steps take the torch path")


def _need_batched(model) -> None:
    """Skip where the batched layer does not run at this tier (no AMX, and the native bf16
    dot products are not the torch path's linears here): rows_why says why."""
    why = _layers(model)[0].forward.decode_layer().rows_why
    if why is not None:
        pytest.skip(f"batched steps take the torch path here: {why}")


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each row's positions counted from its first real token, as generate() passes them for
    left-padded rows (padding at 1): the rows' cos / sin then differ."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _step_logits(model, ids, mask, native: bool, monkeypatch, steps: int = 4,
                 row_positions: bool = False):
    """Prefill (torch path), then `steps` one-token steps on the same tokens; logits [steps, V]
    for one sequence, [steps, B, V] for B. row_positions: position_ids per row (_positions),
    else HF's default (the same positions in every row)."""
    b = ids.shape[0]
    with monkeypatch.context() as m:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            extra = {"position_ids": _positions(mask)} if row_positions else {}
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
            if not native:
                switch(m, native=False)
            out = []
            for i in range(steps):
                mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
                tok = torch.tensor([[5 + 7 * i + 3 * r] for r in range(b)])
                extra = {"position_ids": _positions(mask)[:, -1:]} if row_positions else {}
                logits = model(tok, attention_mask=mask, past_key_values=cache,
                               use_cache=True, **extra).logits
                out.append(logits[:, -1].float() if b > 1 else logits[0, -1].float())
    return torch.stack(out)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 layer outputs differ in the last bit where sums run in another order; the logits of
    two layers stay within a few bf16 ulps of their scale, and pick the same tokens but in the rare
    near-tie that difference breaks the other way (seen on phi3 in bf16 with torch's own
    kernels capped at AVX2)."""
    scale = b.abs().max()
    diff = (a - b).abs().max()
    assert diff <= 0.03 * scale, (diff, scale)
    # A token may differ only where the reference's two best logits lie within 2 * diff (a
    # near-tie the measured difference can break; implied by the bound above), and only rarely.
    flipped = a.argmax(-1) != b.argmax(-1)
    assert flipped.float().mean() <= 0.25, ("tokens differ in too many rows", a.argmax(-1),
                                            b.argmax(-1))


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "llama_wide"])
def test_decode_steps_match_the_torch_path(name, quant, monkeypatch):
    # (llama_wide's int4 steps: test_int4_group_sizes; its int8 logits hold a near-tie)
    model = _inject(_model(name), QUANTS[quant])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 9), generator=gen)
    mask = torch.ones(1, 9, dtype=torch.long)
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    assert _native_calls(model) == 0
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert _native_calls(model) == 4 * len(model.model.layers)  # every step, every layer
    _close(native, torch_path)


@pytest.mark.parametrize(("group", "hidden", "inter"), [(64, 192, 320), (128, 128, 256),
                                                       (256, 256, 512), (32, 640, 1024),
                                                       (128, 768, 1536), (256, 1024, 512)])
def test_int4_group_sizes(group, hidden, inter, monkeypatch):
    """Every int4 group size: the kernel maps each 8-column lane of a 128-column chunk to its
    group (4 or 2 groups per chunk, or a group over 1 or 2 chunks), and each 32-column lane of
    a 512-column run (16, 8, 4 or 2 groups per run) in the tiles' order."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**_BASE, "hidden_size": hidden, "intermediate_size": inter,
                            "num_attention_heads": hidden // 32, "num_key_value_heads": 2})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = _inject(model, {"bits": 4, "group_size": group})
    assert model.model.layers[0].mlp.down_proj.quantized.group_size == group
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 9, dtype=torch.long)
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert _native_calls(model) == 4 * len(model.model.layers)
    _close(native, torch_path)


@pytest.mark.parametrize("name,group", [("llama", 32), ("llama", 128), ("llama_odd", 32),
                                        ("llama_wide", 32), ("llama_wide", 64)])
def test_int4_projections_against_float64(name, group):
    """q, k, v of the native int4 kernel (x as 16-bit fixed point per group, integer dots)
    against the dequantized weights in float64, on an x whose groups span 1e-3..1e2: within the
    bf16 rounding of the output (half an ulp, at most 2^-8 of it) plus 1e-4 of the largest output."""
    from hf_dsinfer.kernels.quant import dequantize_int4

    model = _inject(_model(name), {"bits": 4, "group_size": group})
    block = model.model.layers[0].forward
    layer = block.decode_layer()
    tiled = block._qkv[0].quantized.tiled
    kind = abi.LIN_INT4_TILED if tiled else abi.LIN_INT4
    assert layer is not None and layer.struct.lin[0].kind == kind
    assert tiled == (name != "llama_odd")  # llama_odd's rows are not whole tiles: both run
    hidden, d = block._ln1.weight.shape[0], block.spec.head_dim
    torch.manual_seed(5)
    x = torch.randn(1, 1, hidden) * torch.logspace(-3, 2, hidden)[torch.randperm(hidden)]
    x = x.bfloat16()
    with torch.inference_mode():
        block._ln1.weight.fill_(1.0)  # h = x / rms(x): the norm keeps the spread of x
        q, k, v = layer.attn_in(x, torch.ones(d, dtype=torch.bfloat16),
                                torch.zeros(d, dtype=torch.bfloat16))  # rotation: identity
        h = block._norm(block._ln1, x).double().reshape(-1)
    for proj, out in zip(block._qkv, (q, k, v)):
        ref = dequantize_int4(proj.quantized, torch.float32).double() @ h
        got = out.double().reshape(-1)
        bound = ref.abs() * 2.0**-8 + 1e-4 * ref.abs().max()  # half a bf16 ulp: <= 2^-8 |ref|
        assert ((got - ref).abs() <= bound).all(), ((got - ref).abs().max(), ref.abs().max())


def test_left_padding_masks_the_padded_keys(monkeypatch):
    """A batch-1 prompt with left padding: the native attention reads HF's mask."""
    model = _inject(_model("llama"))
    ids = torch.tensor([[0, 0, 0, 17, 33, 41, 9]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert _native_calls(model) > 0
    _close(native, torch_path)
    unpadded = _step_logits(model, ids[:, 3:], mask[:, 3:], True, monkeypatch)
    assert (unpadded - native).abs().max() <= 0.03 * native.abs().max()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_generate_tokens_match_the_torch_path(cache, grad_mode, monkeypatch):
    """generate() with a dynamic or a static cache (the kernel reads the static cache's valid
    keys through the mask), under inference_mode and no_grad."""
    model = _inject(_model("llama_d64", seed=1), {"bits": 8})
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = {"max_new_tokens": 10, "do_sample": False, "cache_implementation": cache,
              "disable_compile": True, "pad_token_id": 0}
    context = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    with context():
        native = model.generate(ids, **kwargs)
        calls = _native_calls(model)
        switch(monkeypatch, native=False)
        torch_path = model.generate(ids, **kwargs)
    assert calls == 9 * len(model.model.layers)  # 10 tokens: a prefill and 9 decode steps
    assert torch.equal(native, torch_path)


def test_calls_it_does_not_compute_take_the_torch_path(monkeypatch):
    """Grad enabled and fp32 models run the torch path; explain says why. int4 batches run the
    batched layer where its kernels run (on AMX: hfd_int4_linear / hfd_int4_amx)."""
    model = _inject(_model("llama"), QUANTS["int4"])
    layer = model.model.layers[0].forward.decode_layer()
    if _native.amx_available():
        assert layer.rows_why is None
    before = _row_calls(model)
    with torch.no_grad():
        model.generate(torch.randint(3, VOCAB, (2, 5)), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    assert _native_calls(model) == 0
    if layer.rows_why is None:  # 2 one-token steps after the prefill
        assert _row_calls(model) - before == 2 * len(model.model.layers)
    else:
        assert _row_calls(model) == before
        assert f"batched steps: torch ops ({layer.rows_why}" in hf_dsinfer.explain(model)
    model = _inject(_model("llama"))
    cache = DynamicCache(config=model.config)
    model(torch.tensor([[4, 5]]), past_key_values=cache, use_cache=True)  # grad enabled
    model(torch.tensor([[6]]), past_key_values=cache, use_cache=True)
    assert _native_calls(model) == 0
    assert "native layer, kernels/csrc/cpu_decode.c, in all 2 blocks" in hf_dsinfer.explain(model)
    fp32 = hf_dsinfer.init_inference(_model("llama").float())
    assert "bf16 models only" in hf_dsinfer.explain(fp32)
    gpt2 = hf_dsinfer.init_inference(AutoModelForCausalLM.from_config(
        __import__("transformers").GPT2Config(n_embd=64, n_head=2, n_layer=1, vocab_size=VOCAB),
        dtype=torch.bfloat16))
    assert "torch ops otherwise (not separate q/k/v" in hf_dsinfer.explain(gpt2)
    switch(monkeypatch, native=False)
    assert "disabled by settings native=False (HF_DSINFER_NATIVE=0)" in hf_dsinfer.explain(model)


def test_replaced_weights_rebuild_the_layer(monkeypatch):
    """The layer points into the model's tensors: new weights (a reload, .to(), an edited
    parameter) are noticed before the next call, never read stale."""
    model = _inject(_model("llama"))
    block = model.model.layers[0].forward
    ids, mask = torch.tensor([[7, 8, 9]]), torch.ones(1, 3, dtype=torch.long)
    _step_logits(model, ids, mask, True, monkeypatch, steps=1)
    first = block._decode
    q = block.block.self_attn.q_proj
    with torch.no_grad():
        q.weight = torch.nn.Parameter(torch.randn_like(q.weight))
    native = _step_logits(model, ids, mask, True, monkeypatch, steps=2)
    assert block._decode is not first
    torch_path = _step_logits(model, ids, mask, False, monkeypatch, steps=2)
    _close(native, torch_path)
    # a quantized linear's scales buffer replaced (not its codes): also noticed
    model = _inject(_model("llama"), {"bits": 8})
    block = model.model.layers[0].forward
    _step_logits(model, ids, mask, True, monkeypatch, steps=1)
    first = block._decode
    down = block.block.mlp.down_proj
    down.scales = down.scales * 3
    native = _step_logits(model, ids, mask, True, monkeypatch, steps=2)
    assert block._decode is not first
    _close(native, _step_logits(model, ids, mask, False, monkeypatch, steps=2))


def _layer_rest_fp64(block, x, q, k, v, keep):
    """The layer after the cache update in float64 with no rounding: attention over the kept
    keys, o_proj, residual, RMSNorm, SiLU-gated MLP, residual."""
    d = torch.float64
    a = attention_ref(q.to(d), k.to(d), v.to(d), scale=block.spec.scale,
                      mask=keep.view(1, 1, 1, -1))
    x1 = x.to(d) + a.transpose(1, 2).reshape(1, 1, -1) @ block._out.weight.to(d).t()

    def rms(t, norm):
        return norm.weight.to(d) * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)
                                                   + _norm_eps(norm))

    h = rms(x1, block._ln2)
    gate, up = (h @ m.weight.to(d).t() for m in block._mlp_in)
    return x1 + (torch.nn.functional.silu(gate) * up) @ block._mlp_out.weight.to(d).t()


def test_native_layer_against_float64():
    """The rest of the layer on a cache of 70 keys (more than a vector of scores) with a keep
    mask: as close to float64 as the torch path is."""
    model = _inject(_model("llama"))
    block = model.model.layers[1].forward
    layer = block.decode_layer()
    torch.manual_seed(4)
    x = torch.randn(1, 1, 128).bfloat16()
    q = torch.randn(1, 4, 1, 32).bfloat16()
    k = torch.randn(1, 2, 70, 32).bfloat16()
    v = torch.randn(1, 2, 70, 32).bfloat16()
    keep = torch.rand(70) > 0.3
    with torch.inference_mode():
        native = layer.attn_out(x, q, k, v, keep.view(torch.uint8))
        attn = block._attend(q, k, v, {"attention_mask": keep.view(1, 1, 1, 70)}, 1, 1)
        torch_path = block._sequential(x, {}, attn=attn)
    ref = _layer_rest_fp64(block, x, q, k, v, keep)
    err_native = (native.double() - ref).abs().max()
    err_torch = (torch_path.double() - ref).abs().max()
    assert err_native <= 2 * err_torch + 1e-3 * ref.abs().max(), (err_native, err_torch)
    none_kept = layer.attn_out(x, q, k, v, torch.zeros(70, dtype=torch.uint8))
    assert torch.isfinite(none_kept).all()  # a fully masked row attends nothing, never NaN


def _padded_batch(b: int, s: int, seed: int = 3):
    """B prompts of s tokens; row r is left-padded by r tokens (row 0 unpadded)."""
    ids = torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, s, dtype=torch.long)
    for r in range(b):
        mask[r, :r] = 0
        ids[r, :r] = 0
    return ids, mask


@pytest.mark.amx
@BATCHED
@pytest.mark.skipif(not _native.amx_int8_available(), reason="no AMX-INT8: int8 batches: torch")
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_wide"])
def test_batched_int8_steps_equal_the_torch_path(name, monkeypatch):
    """int8 row tiles in the batched layer (hfd_int8_amx, the torch path's kernel for those
    rows, so the projections are the same bits; attention and norms round in another order)."""
    model = _inject(_model(name), {"bits": 8})
    assert all(layer.forward.decode_layer().rows_why is None for layer in _layers(model))
    _batched_against_torch_path(model, monkeypatch)


@pytest.mark.amx
@BATCHED
@pytest.mark.parametrize("kernel", ["hfd_int4_linear", "hfd_int4_amx"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_wide"])
def test_batched_int4_steps_equal_the_torch_path(name, kernel, monkeypatch):
    """4-bit codes in the batched layer on AMX: the torch path's kernel for the rows (the int4
    dot-product kernel up to int4_native_max_rows, pinned to 2 here for the AMX kernel to take
    the three sequences), so the projections are the same bits; qwen2 adds q/k/v biases after
    the rounding as the torch path does."""
    if kernel == "hfd_int4_amx":
        pin_crossovers(monkeypatch, int4_native_max_rows=2)
    rows, original = [], Q._native_int4_amx

    def counted(x2, qweight):
        rows.append(x2.shape[0])
        return original(x2, qweight)

    monkeypatch.setattr(Q, "_native_int4_amx", counted)
    model = _inject(_model(name), QUANTS["int4"])
    assert all(layer.forward.decode_layer().rows_why is None for layer in _layers(model))
    _batched_against_torch_path(model, monkeypatch)
    # the torch path's one-token steps of three sequences ran the AMX kernel, or did not
    assert (3 in rows) == (kernel == "hfd_int4_amx"), rows


@pytest.mark.parametrize("kernels", ["gemv", "panel"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_batched_quantized_steps_without_amx(quant, kernels, monkeypatch):
    """Without AMX the batched layer takes int8 / int4 weights with the torch path's kernels for
    the rows: the quantized GEMVs for a few rows, the panel kernels past the tier's bound
    (pinned here to 2 rows, so that three sequences run them)."""
    if _native.amx_available():
        pytest.skip("with AMX the batched layer runs the AMX kernels (tests above)")
    if kernels == "panel":
        pin_crossovers(monkeypatch, int8_gemv_max_rows=2, int4_native_max_rows=2)
    model = _inject(_model("llama"), QUANTS[quant])
    _need_batched(model)
    _batched_against_torch_path(model, monkeypatch)


def _batched_against_torch_path(model, monkeypatch) -> None:
    """Three sequences, two of them left-padded, one token each per step: the batched layer
    against the torch path (counted), logits within a few bf16 ulps of their scale and the same
    choice wherever the torch path's top two logits are further apart than that."""
    ids, mask = _padded_batch(3, 9)
    before = _row_calls(model)  # init_inference's parity check ran a batched step
    torch_path = _step_logits(model, ids, mask, False, monkeypatch, row_positions=True)
    assert _row_calls(model) == before
    native = _step_logits(model, ids, mask, True, monkeypatch, row_positions=True)
    assert _row_calls(model) - before == 4 * len(model.model.layers)
    diff = (native - torch_path).abs().max()
    assert diff <= 0.03 * torch_path.abs().max(), diff
    top2 = torch_path.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert clear.float().mean() > 0.5
    assert torch.equal(native.argmax(-1)[clear], torch_path.argmax(-1)[clear])


@pytest.mark.parametrize("name", ["llama", "llama_d64", "qwen2", "mistral", "llama_odd", "qwen3",
                                  "smollm3", "granite", "phi3", "seed_oss", "ernie4_5", "glm",
                                  "hunyuan_v1_dense"])
def test_batched_decode_steps_match_the_torch_path(name, monkeypatch):
    """Three sequences, two of them left-padded, one token each per step: the batched layer
    (per-row positions, masks and keys) against the torch path, row by row."""
    model = _inject(_model(name))
    _need_batched(model)
    _batched_against_torch_path(model, monkeypatch)
    layer = model.model.layers[0].forward.decode_layer()
    assert f"batched steps (2-{layer.rows_max} sequences): native layer" in hf_dsinfer.explain(
        model)


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("mode", ["greedy", "beams", "sample"])
def test_batched_generate_matches_the_torch_path(mode, grad_mode, monkeypatch):
    """generate() over a padded batch: greedy, beam search (the cache is reordered between
    steps) and sampling take the same tokens with the batched layer as with the torch path.
    Greedy tokens may part only at a near-tie of the torch path's logits: the two paths'
    logits differ in their last bf16 bits (torch's own ops round otherwise under some
    ATEN_CPU_CAPABILITY settings, e.g. avx2), and a tie within that breaks either way."""
    model = _inject(_model("llama_d64", seed=2))
    _need_batched(model)
    ids, mask = _padded_batch(3, 6, seed=8)
    kwargs = {"max_new_tokens": 8, "disable_compile": True, "pad_token_id": 0,
              "attention_mask": mask, "do_sample": mode == "sample",
              "return_dict_in_generate": True, "output_scores": mode == "greedy"}
    if mode == "beams":
        kwargs.update(num_beams=2, early_stopping=False)
    context = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    before = _row_calls(model)  # init_inference's parity check ran a batched step
    with context():
        torch.manual_seed(0)
        native = model.generate(ids, **kwargs)
        calls = _row_calls(model) - before
        switch(monkeypatch, native=False)
        torch.manual_seed(0)
        torch_path = model.generate(ids, **kwargs)
    assert calls == 7 * len(model.model.layers)  # a prefill and 7 one-token steps
    if mode != "greedy":
        assert torch.equal(native.sequences, torch_path.sequences)
        return
    new = native.sequences[:, ids.shape[1]:], torch_path.sequences[:, ids.shape[1]:]
    for row in range(ids.shape[0]):
        differ = (new[0][row] != new[1][row]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])  # the first step where they part: the torch path's top two
        top2 = torch_path.scores[step][row].float().topk(2).values
        scale = torch_path.scores[step][row].float().abs().max()
        assert top2[0] - top2[1] <= 0.03 * scale, (row, step, top2, scale)


def test_batched_layer_against_float64_and_batch_one():
    """attn_out_rows on 3 rows with their own keep rows (one row keeps nothing): each row as
    close to float64 as the torch path is, and equal to the batch-1 layer on that row up to
    the last bits (sums in another order)."""
    model = _inject(_model("llama"))
    _need_batched(model)
    block = model.model.layers[1].forward
    layer = block.decode_layer()
    assert layer.rows_why is None
    torch.manual_seed(4)
    x = torch.randn(3, 1, 128).bfloat16()
    q, k, v = torch.randn(3, 1, 4, 32).bfloat16().transpose(1, 2), *(
        torch.randn(3, 2, 70, 32).bfloat16() for _ in range(2))
    keep = torch.rand(3, 70) > 0.3
    keep[2] = False
    with torch.inference_mode():
        rows = layer.attn_out_rows(x, q, k, v, keep.view(torch.uint8))
        for r in range(3):
            one = layer.attn_out(x[r:r + 1].contiguous(), q[r:r + 1].contiguous(), k[r:r + 1],
                                 v[r:r + 1], keep[r].contiguous().view(torch.uint8))
            assert (rows[r] - one[0]).abs().max() <= 0.02 * one.abs().max()
            if r == 2:
                assert torch.isfinite(rows[r]).all()
                continue
            named = {"attention_mask": keep[r].view(1, 1, 1, 70)}
            attn = block._attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], named, 1, 1)
            torch_path = block._sequential(x[r:r + 1], {}, attn=attn)
            ref = _layer_rest_fp64(block, x[r:r + 1], q[r:r + 1], k[r:r + 1], v[r:r + 1],
                                   keep[r])
            err_rows = (rows[r].double() - ref).abs().max()
            err_torch = (torch_path.double() - ref).abs().max()
            assert err_rows <= 2 * err_torch + 1e-3 * ref.abs().max(), (err_rows, err_torch)
        # q, k, v of a batch against the batch-1 projections of each row
        cos, sin = torch.randn(2, 3, 32).bfloat16()
        qb, kb, vb = layer.attn_in_rows(x, cos, sin)
        for r in range(3):
            q1, k1, v1 = layer.attn_in(x[r:r + 1].contiguous(), cos[r], sin[r])
            for a, b in ((qb, q1), (kb, k1), (vb, v1)):
                assert (a[r] - b[0]).abs().max() <= 0.02 * b.abs().max()


def test_keep_rows_shapes():
    assert native_decode.keep_rows(None, 3, 5) == (True, None)
    masked = torch.finfo(torch.float32).min
    ok, keep = native_decode.keep_rows(torch.tensor([[[[0.0, masked, 0.0]]]]), 1, 3)
    assert ok and keep.tolist() == [[1, 0, 1]]
    assert not native_decode.keep_rows(torch.tensor([[[[0.0, -1e30, 0.5]]]]), 1, 3)[0]  # a bias
    ok, keep = native_decode.keep_rows(torch.ones(1, 1, 1, 8, dtype=torch.bool), 1, 5)  # static
    assert ok and keep.shape == (1, 5)
    mask = torch.zeros(2, 1, 1, 4)
    mask[1, 0, 0, 0] = masked
    ok, keep = native_decode.keep_rows(mask, 2, 4)
    assert ok and keep.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    ok, keep = native_decode.keep_rows(torch.ones(1, 1, 1, 9, dtype=torch.bool), 3, 5)
    assert ok and keep.shape == (1, 5)  # one row for all: stride 0 in the kernel
    assert not native_decode.keep_rows(torch.ones(3, 2, 1, 5, dtype=torch.bool), 3, 5)[0]
    assert not native_decode.keep_rows(torch.ones(2, 1, 1, 5, dtype=torch.bool), 3, 5)[0]
    assert not native_decode.keep_rows(mask + 0.5, 2, 4)[0]  # a bias, not a mask


@pytest.mark.amx
@BATCHED
def test_batched_layer_follows_the_amx_switch_and_checks_its_inputs(monkeypatch):
    """HF_DSINFER_NATIVE_AMX=0 set after the layer was built sends batches to the torch path
    (as it does the torch path's linears); wrong shapes raise instead of reading past a
    buffer."""
    model = _inject(_model("llama"))
    ids, mask = _padded_batch(2, 5)
    before = _row_calls(model)
    _step_logits(model, ids, mask, True, monkeypatch, steps=1)
    assert _row_calls(model) == before + len(model.model.layers)
    switch(monkeypatch, amx=False)
    _step_logits(model, ids, mask, True, monkeypatch, steps=1)
    assert _row_calls(model) == before + len(model.model.layers)
    assert "batched steps: torch ops (AMX switched off" in hf_dsinfer.explain(model)


def test_batched_layer_checks_its_inputs():
    """Wrong shapes raise instead of reading past a buffer."""
    model = _inject(_model("llama"))
    _need_batched(model)
    layer = model.model.layers[0].forward.decode_layer()
    x = torch.randn(2, 1, 128).bfloat16()
    cos, sin = torch.randn(2, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="cos must be"):
        layer.attn_in_rows(x, cos[0, 0], sin[0, 0])  # the batch-1 [d] convention
    with pytest.raises(ValueError, match="x must be"):
        layer.attn_in_rows(x.float(), cos, sin)
    q = layer.attn_in_rows(x, cos, sin)[0]
    keys = torch.randn(2, 2, 5, 32).bfloat16()
    with pytest.raises(ValueError, match="keep must be"):
        layer.attn_out_rows(x, q, keys, keys, torch.ones(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="k, v must be"):
        layer.attn_out_rows(x, q, keys[:1], keys[:1], None)
    assert layer.attn_out_rows(x, q, keys, keys, None).shape == x.shape
    with pytest.raises(ValueError, match="a must be"):
        layer.post_attn_rows(x, torch.randn(2, 64).bfloat16())
    assert layer.post_attn_rows(x, torch.randn(2, 128).bfloat16()).shape == x.shape


def test_post_attn_rows_is_attn_out_rows_after_its_attention():
    """post_attn_rows on the attention of continuous batching's rows (each over its own keys in
    the packed cache, one hfd_attend_rows call) gives attn_out_rows' bits: the same attention
    code, then the same rest of the layer. 5 rows: past the bf16 GEMV's 4 (the panel kernel
    without AMX)."""
    from hf_dsinfer.kernels.attention import attend_rows_native

    model = _inject(_model("llama"))
    _need_batched(model)
    layer = model.model.layers[1].forward.decode_layer()
    torch.manual_seed(5)
    b, sk, kv, d = 5, 40, 2, 32
    x = torch.randn(b, 1, 128).bfloat16()
    q = torch.randn(b, 1, 4, d).bfloat16().transpose(1, 2)  # attn_in_rows' [b, heads, 1, d] view
    k, v = (torch.randn(b, kv, sk, d).bfloat16() for _ in range(2))
    keep = torch.rand(b, sk) > 0.3
    keep[:, 0] = True
    with torch.inference_mode():
        ref = layer.attn_out_rows(x, q, k, v, keep.view(torch.uint8))
        packed_k, packed_v = (t.permute(1, 0, 2, 3).reshape(1, kv, b * sk, d) for t in (k, v))
        spans = torch.tensor([(i, i * sk, (i + 1) * sk) for i in range(b)])
        packed_keep = torch.zeros(b, b * sk, dtype=torch.uint8)
        for i in range(b):
            packed_keep[i, i * sk:(i + 1) * sk] = keep[i].view(torch.uint8)
        a = torch.empty(b, 4, d, dtype=torch.bfloat16)
        attend_rows_native(q.permute(2, 1, 0, 3), packed_k, packed_v, spans, packed_keep,
                           layer.struct.scale, layer.struct.softcap, a.permute(1, 0, 2)[None])
        assert torch.equal(layer.post_attn_rows(x, a.view(b, 4 * d)), ref)


# ---- OPT's layout: LayerNorm with bias, learned positions (added before the blocks), q scaled
# after its projection, a bias on every projection, fc1 -> ReLU -> fc2 ----

def _opt(seed: int = 0, **overrides):
    config = OPTConfig(vocab_size=VOCAB, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=256,
                       word_embed_proj_dim=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # HF starts biases at 0 and LayerNorms at (1, 0): make them matter
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.normal_(m.bias, std=0.3)
            elif isinstance(m, torch.nn.LayerNorm):
                torch.nn.init.normal_(m.weight, mean=1.0, std=0.2)
                torch.nn.init.normal_(m.bias, std=0.2)
    return model


@pytest.mark.parametrize("quant", list(QUANTS))
def test_opt_decode_steps_match_the_torch_path_and_hf(quant, monkeypatch):
    """Every weight format on OPT's layout: the native layer against the torch path of the
    same fused model, and (bf16) against HF eager itself."""
    hf = _opt()
    model = _inject(_opt(), QUANTS[quant])
    assert all(layer.forward.decode_why is None for layer in _layers(model))
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 9, dtype=torch.long)
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    assert _native_calls(model) == 0
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert _native_calls(model) == 4 * len(_layers(model))  # every step, every layer
    _close(native, torch_path)
    if quant == "bf16":
        _close(native, _step_logits(hf, ids, mask, True, monkeypatch))


def test_opt_layer_rounds_where_hf_rounds():
    """One decode step of one OPT layer, native against HF's own OPTDecoderLayer forward on the
    same cache: bf16 outputs equal but for the last bit of the few elements whose sums ran in
    another order."""
    model = _inject(_opt(seed=1))
    block = _layers(model)[1].forward
    layer = block.decode_layer()
    torch.manual_seed(6)
    past_k, past_v = (torch.randn(1, 4, 11, 32).bfloat16() for _ in range(2))
    x = torch.randn(1, 1, 128).bfloat16()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        cache.update(past_k, past_v, block.spec.layer_idx)
        hf = block.hf_forward(x, attention_mask=None, past_key_values=cache)
        q, k, v = layer.attn_in(x, None, None)
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        native = layer.attn_out(x, q, keys, values, None)
        # the new token's key / value are HF's
        assert torch.equal(keys, cache.layers[block.spec.layer_idx].keys)
    hf = hf[0] if isinstance(hf, tuple) else hf
    ulp = 2.0 ** (torch.floor(torch.log2(hf.float().abs().clamp_min(1e-30))) - 7)
    diff = (native.float() - hf.float()).abs()
    assert (diff <= ulp).all(), (diff / ulp).max()
    assert (diff == 0).float().mean() >= 0.9


def test_opt_layer_against_float64():
    """LayerNorm, the query scaling, biases and the ReLU MLP after a 70-key attention with a
    keep mask: as close to float64 as the torch path is."""
    model = _inject(_opt(seed=2))
    block = _layers(model)[0].forward
    layer = block.decode_layer()
    torch.manual_seed(4)
    x = torch.randn(1, 1, 128).bfloat16()
    k, v = (torch.randn(1, 4, 70, 32).bfloat16() for _ in range(2))
    keep = torch.rand(70) > 0.3
    with torch.inference_mode():
        q = layer.attn_in(x, None, None)[0]  # scaled by head_dim ** -0.5 already
        native = layer.attn_out(x, q, k, v, keep.view(torch.uint8))
        attn = block._attend(q, k, v, {"attention_mask": keep.view(1, 1, 1, 70)}, 1, 1,
                             q_scaled=True)
        torch_path = block._sequential(x, {}, attn=attn)
    d = torch.float64

    def lin(t, m):
        return t @ m.weight.to(d).t() + m.bias.to(d)

    def ln(t, norm):
        return torch.nn.functional.layer_norm(t, (128,), norm.weight.to(d), norm.bias.to(d),
                                              _norm_eps(norm))

    a = attention_ref(q.to(d), k.to(d), v.to(d), scale=1.0, mask=keep.view(1, 1, 1, -1))
    x1 = x.to(d) + lin(a.transpose(1, 2).reshape(1, 1, -1), block._out)
    ref = x1 + lin(torch.relu(lin(ln(x1, block._ln2), block._mlp_in[0])), block._mlp_out)
    err_native = (native.double() - ref).abs().max()
    err_torch = (torch_path.double() - ref).abs().max()
    assert err_native <= 2 * err_torch + 1e-3 * ref.abs().max(), (err_native, err_torch)
    with pytest.raises(ValueError, match="needs cos and sin"):
        _layers(_inject(_model("llama")))[0].forward.decode_layer().attn_in(x, None, None)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_opt_batched_generate_matches_the_torch_path(mode, cache, monkeypatch):
    """generate() over a left-padded OPT batch (positions from the mask, before the blocks):
    the batched layer takes the torch path's tokens, with either cache."""
    model = _inject(_opt(seed=3))
    _need_batched(model)
    ids, mask = _padded_batch(3, 6, seed=8)
    kwargs = {"max_new_tokens": 8, "disable_compile": True, "pad_token_id": 0,
              "attention_mask": mask, "do_sample": False, "cache_implementation": cache}
    if mode == "beams":
        kwargs.update(num_beams=2, early_stopping=False)
    assert "sequences): native layer" in hf_dsinfer.explain(model)
    before = _row_calls(model)
    with torch.inference_mode():
        native = model.generate(ids, **kwargs)
        calls = _row_calls(model) - before
        switch(monkeypatch, native=False)
        torch_path = model.generate(ids, **kwargs)
    assert calls == 7 * len(_layers(model))
    assert torch.equal(native, torch_path)


def test_opt_layouts_the_kernel_does_not_compute_take_the_torch_path(monkeypatch):
    """OPT-350m's post-LN blocks and a GELU MLP run the torch path, and explain says why."""
    post_ln = _inject(_opt(do_layer_norm_before=False))
    gelu = _inject(_opt(activation_function="gelu"))
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    for model, why in ((post_ln, "not a pre-norm block"),
                       (gelu, ("not separate q/k/v with an MLP the C layer computes (SiLU- or "
                               "GELU-gated; ReLU, squared ReLU or tanh GELU)"))):
        _step_logits(model, ids, mask, True, monkeypatch, steps=2)
        assert _native_calls(model) == 0
        assert all(layer.forward.decode_why == why for layer in _layers(model))
        assert why in hf_dsinfer.explain(model)
