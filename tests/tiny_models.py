"""Tiny random HF models, one per supported family and variant, built from configs (no
downloads). Odd sizes on purpose: hidden 80 with 5 heads of 16, GQA with 3 or 1 KV heads,
partial rotary, a 4-token sliding window, post-LN OPT with project_in/out."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    ApertusConfig,
    ArceeConfig,
    AutoModelForCausalLM,
    BloomConfig,
    Cohere2Config,
    CohereConfig,
    CwmConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneMoeConfig,
    FalconConfig,
    FlexOlmoConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    GraniteMoeSWAConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    HyperCLOVAXConfig,
    InternLM3Config,
    Jais2Config,
    LlamaConfig,
    MiniCPM3Config,
    MiniMaxM2Config,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    NemotronConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
    StableLmConfig,
    Starcoder2Config,
    VaultGemmaConfig,
    XGLMConfig,
    YoutuConfig,
)

VOCAB = 101
# initializer_range is raised from HF's 0.02 so that random logits have a clear argmax: greedy
# parity tests must not hinge on near-ties.
_COMMON = {"vocab_size": VOCAB, "initializer_range": 0.15, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0}
_LLAMA = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=3, head_dim=16,
              max_position_embeddings=128, **_COMMON)

CONFIGS = {
    "gpt2": lambda: GPT2Config(n_embd=80, n_head=5, n_layer=2, n_positions=128,
                               activation_function="gelu_new", **_COMMON),
    "opt": lambda: OPTConfig(hidden_size=80, num_attention_heads=5, num_hidden_layers=2,
                             ffn_dim=144, max_position_embeddings=128, word_embed_proj_dim=80,
                             **_COMMON),
    "opt_post_ln": lambda: OPTConfig(hidden_size=80, num_attention_heads=5, num_hidden_layers=2,
                                     ffn_dim=144, max_position_embeddings=128,
                                     do_layer_norm_before=False, word_embed_proj_dim=48,
                                     **_COMMON),
    "bloom": lambda: BloomConfig(hidden_size=80, n_head=5, n_layer=2, **_COMMON),
    "gpt_neox": lambda: GPTNeoXConfig(hidden_size=80, num_attention_heads=5, num_hidden_layers=2,
                                      intermediate_size=144, rotary_pct=0.5,
                                      max_position_embeddings=128, use_parallel_residual=True,
                                      **_COMMON),
    "gpt_neox_sequential": lambda: GPTNeoXConfig(
        hidden_size=80, num_attention_heads=5, num_hidden_layers=2, intermediate_size=144,
        rotary_pct=0.25, max_position_embeddings=128, use_parallel_residual=False, **_COMMON),
    # StarCoder 1 / SantaCoder: GPT-2's block, nn.Linear weights, multi-query attention
    "gpt_bigcode": lambda: GPTBigCodeConfig(n_embd=80, n_head=5, n_layer=2, n_positions=128,
                                            multi_query=True,
                                            activation_function="gelu_pytorch_tanh", **_COMMON),
    "gptj": lambda: GPTJConfig(n_embd=80, n_head=5, n_layer=2, rotary_dim=8, n_positions=128,
                               **_COMMON),
    "llama": lambda: LlamaConfig(**_LLAMA),
    "mistral": lambda: MistralConfig(**{**_LLAMA, "hidden_size": 80, "num_attention_heads": 5,
                                        "num_key_value_heads": 1}, sliding_window=4),
    "qwen2": lambda: Qwen2Config(**{**_LLAMA, "num_hidden_layers": 3, "num_key_value_heads": 2},
                                 use_sliding_window=True, sliding_window=4, max_window_layers=1),
    # the 2026 families (issue 27). Input sizes that int4 groups of 32 divide (64, 96, 160).
    # Qwen3: per-head q/k norm, 6 heads x 16 = 96 on a hidden size of 64, layer 1 sliding.
    "qwen3": lambda: Qwen3Config(**{**_LLAMA, "hidden_size": 64, "num_key_value_heads": 2},
                                 use_sliding_window=True, sliding_window=4, max_window_layers=1),
    # SmolLM3: layer 2 of 3 is NoPE (and sliding, as SmolLM3 slides only NoPE layers)
    "smollm3": lambda: SmolLM3Config(**{**_LLAMA, "num_hidden_layers": 3},
                                     no_rope_layer_interval=3, use_sliding_window=True,
                                     sliding_window=4),
    "granite": lambda: GraniteConfig(**_LLAMA, embedding_multiplier=3.0, residual_multiplier=0.6,
                                     attention_multiplier=0.2, logits_scaling=0.8),
    # OLMo 2: q/k norm over the whole (GQA) projections, post-norms only
    "olmo2": lambda: Olmo2Config(**_LLAMA),
    # OLMo 3: OLMo 2's block, sliding (window 4) / global layers
    "olmo3": lambda: Olmo3Config(**_LLAMA, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"]),
    # Gemma (1): Llama's block with (1 + w) RMSNorms and GeGLU
    "gemma": lambda: GemmaConfig(**_LLAMA, hidden_act="gelu_pytorch_tanh"),
    # Gemma 2: sliding (window 4) / global layers alternating, a query_pre_attn_scalar other
    # than head_dim, attention and final logit soft-caps small enough to bite
    "gemma2": lambda: Gemma2Config(**{**_LLAMA, "num_hidden_layers": 3}, sliding_window=4,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                   final_logit_softcapping=10.0),
    # Gemma 3: sliding, global, sliding, with RoPE bases 10k (local) / 1M (global)
    "gemma3_text": lambda: Gemma3TextConfig(
        **{**_LLAMA, "num_hidden_layers": 3}, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Phi-3: fused qkv_proj (GQA 6 / 2 heads) and gate_up_proj, half the head rotated, window 4
    "phi3": lambda: Phi3Config(**{**_LLAMA, "num_key_value_heads": 2}, sliding_window=4,
                               partial_rotary_factor=0.5),
    # Llama's block under other names (the llama policy): Ministral, sliding (window 4) /
    # full / sliding layers; Seed-OSS, biases on q / k / v and the MLP but not on o_proj;
    # InternLM3 (HF builds Llama's classes), biases on every projection
    "ministral": lambda: MinistralConfig(
        **{**_LLAMA, "num_hidden_layers": 3}, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "seed_oss": lambda: SeedOssConfig(**_LLAMA, attention_bias=True, attention_out_bias=False,
                                      mlp_bias=True),
    "internlm3": lambda: InternLM3Config(**_LLAMA, qkv_bias=True, bias=True),
    # VaultGemma: Gemma 2's block without post-norms; sliding (window 4) / global layers
    "vaultgemma": lambda: VaultGemmaConfig(**{**_LLAMA, "num_hidden_layers": 3},
                                           sliding_window=4, query_pre_attn_scalar=24,
                                           attn_logit_softcapping=1.5,
                                           final_logit_softcapping=10.0),
    # RoPE over interleaved pairs from Llama's cos / sin: ERNIE 4.5 (fp32 tables, a bias on
    # every projection) and Helium (fp32 norm multiply, rotation in the model's dtype)
    "ernie4_5": lambda: Ernie4_5Config(**_LLAMA, use_bias=True),
    "helium": lambda: HeliumConfig(**_LLAMA),
    # HunYuan: per-head q / k RMSNorms after RoPE (made distinct by make_model)
    "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**_LLAMA),
    # GLM: fused gate_up_proj, q / k / v biases, half of each head rotated in interleaved
    # pairs; GLM-4: the same with sandwich norms
    "glm": lambda: GlmConfig(**_LLAMA, attention_bias=True, partial_rotary_factor=0.5),
    "glm4": lambda: Glm4Config(**_LLAMA, attention_bias=True, partial_rotary_factor=0.5),
    # Granite SWA: Granite's multipliers, attention sinks (made to count by make_model),
    # sliding (window 4) / full / sliding layers, the full one NoPE (a RoPE base of 0)
    "granite_swa": lambda: GraniteSWAConfig(
        **{**_LLAMA, "num_hidden_layers": 3}, embedding_multiplier=3.0,
        residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=0.8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        layer_rope_theta=[10000.0, 0, 10000.0]),
    # EXAONE 4: post-norms only, per-head q / k norms, sliding (window 4) / global / sliding
    # layers with the global one NoPE; "exaone4_full": no window, so every layer rotates
    "exaone4": lambda: Exaone4Config(
        **{**_LLAMA, "num_hidden_layers": 3}, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "exaone4_full": lambda: Exaone4Config(**_LLAMA, sliding_window=None,
                                          layer_types=["full_attention"] * 2),
    # Cohere: attention and MLP off one fp32 LayerNorm, interleaved RoPE in fp32, a logit scale;
    # Cohere 2: sliding (window 4) / full / sliding layers, the full one NoPE
    "cohere": lambda: CohereConfig(**_LLAMA, logit_scale=0.5),
    "cohere2": lambda: Cohere2Config(
        **{**_LLAMA, "num_hidden_layers": 3}, logit_scale=0.5, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # LayerNorm families (norms randomized by make_model): StarCoder2, biased projections, a
    # plain tanh-GELU MLP, window 4; Phi-2, GPT-J's parallel block, a quarter of each head
    # rotated; StableLM, sequential with q / k / v biases, and parallel; Nemotron, LayerNorm1P
    # (1 + w), squared ReLU, half of each head rotated
    "starcoder2": lambda: Starcoder2Config(**_LLAMA, use_bias=True, sliding_window=4),
    "phi": lambda: PhiConfig(**_LLAMA, partial_rotary_factor=0.25),
    "stablelm": lambda: StableLmConfig(**_LLAMA, use_qkv_bias=True, partial_rotary_factor=0.5),
    "stablelm_parallel": lambda: StableLmConfig(**_LLAMA, use_parallel_residual=True,
                                                partial_rotary_factor=0.25),
    "nemotron": lambda: NemotronConfig(**_LLAMA, partial_rotary_factor=0.5, attention_bias=True,
                                       mlp_bias=True),
    # OLMo (1): LayerNorms without parameters, q / k / v clamped to +-1.5
    "olmo": lambda: OlmoConfig(**_LLAMA, clip_qkv=1.5),
    # Arcee AFM: Llama's block with an up -> squared ReLU -> down MLP
    "arcee": lambda: ArceeConfig(**_LLAMA),
    # Apertus: per-head q / k RMSNorms, an up -> xIELU -> down MLP (the activation's learned
    # parameters made distinct per layer by make_model), llama3 RoPE scaling
    "apertus": lambda: ApertusConfig(**_LLAMA),
    # Code World Model: Llama's block, full / sliding (window 4) / sliding layers, llama3 RoPE
    "cwm": lambda: CwmConfig(**{**_LLAMA, "num_hidden_layers": 3}, sliding_window=4,
                             layer_types=["full_attention", "sliding_attention",
                                          "sliding_attention"],
                             rope_parameters={"rope_type": "llama3", "rope_theta": 1e6,
                                              "factor": 4.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32}),
    # Jais 2: biased projections, LayerNorms, an up -> squared ReLU -> down MLP
    "jais2": lambda: Jais2Config(**_LLAMA, attention_bias=True, mlp_bias=True),
    # HyperCLOVA X: Granite's multipliers (logits multiplied, not divided) with post-norms of
    # both branches before the residual multiplier (Peri-LN)
    "hyperclovax": lambda: HyperCLOVAXConfig(**_LLAMA, embedding_multiplier=3.0,
                                             residual_multiplier=0.6, attention_multiplier=0.2,
                                             logits_scaling=0.8, use_post_norm=True),
    # Youtu-LLM: dense Llama blocks with DeepSeek-V3's MLA (low-rank q, latent 40 + rope 8,
    # interleaved RoPE)
    "youtu": lambda: YoutuConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                 num_hidden_layers=2, intermediate_size=96, q_lora_rank=32,
                                 kv_lora_rank=40, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                 v_head_dim=24, rope_interleave=True,
                                 max_position_embeddings=128, **_COMMON),
    # MiniCPM3: Youtu's MLA with rotate-half RoPE, a residual scale of 0.8 / sqrt(2) per block,
    # embeddings times 3, logits divided by 64 / 32
    "minicpm3": lambda: MiniCPM3Config(hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=4, num_hidden_layers=2,
                                       intermediate_size=96, q_lora_rank=32, kv_lora_rank=40,
                                       qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
                                       scale_emb=3, scale_depth=0.8, dim_model_base=32,
                                       max_position_embeddings=128, **_COMMON),
    # Falcon-40B's block: the new decoder architecture, q / k / v packed per KV head (3 query
    # heads each), ln_attn and ln_mlp in parallel; biases on (the 40B has none) so they count
    "falcon": lambda: FalconConfig(hidden_size=96, num_attention_heads=6, num_kv_heads=2,
                                   new_decoder_architecture=True, num_hidden_layers=2,
                                   ffn_hidden_size=160, bias=True, max_position_embeddings=128,
                                   **_COMMON),
    # Falcon-7B's: multi-query attention off one LayerNorm
    "falcon_7b": lambda: FalconConfig(hidden_size=96, num_attention_heads=6, multi_query=True,
                                      num_hidden_layers=2, ffn_hidden_size=160,
                                      max_position_embeddings=128, **_COMMON),
}
FAMILIES = list(CONFIGS)
FAMILIES_2026 = ["qwen3", "smollm3", "granite", "olmo2", "gemma2", "gemma3_text", "phi3",
                 "olmo3", "gemma", "ministral", "seed_oss",
                 "internlm3", "vaultgemma", "ernie4_5", "helium",
                 "hunyuan_v1_dense", "glm", "glm4", "granite_swa", "exaone4", "exaone4_full",
                 "cohere", "cohere2", "starcoder2", "phi", "stablelm", "stablelm_parallel",
                 "nemotron", "olmo", "arcee", "apertus", "cwm", "jais2", "hyperclovax",
                 "youtu", "minicpm3", "falcon", "falcon_7b"]  # test_family_quant.py covers these
BIASED = ("seed_oss", "internlm3", "ernie4_5", "glm", "glm4", "ernie4_5_moe_bias", "starcoder2",
          "phi", "stablelm", "nemotron", "jais2", "falcon")  # HF initializes biases to zero: make_model randomizes them
LAYER_NORMED = ("starcoder2", "phi", "stablelm", "stablelm_parallel", "nemotron",
                "jais2", "falcon", "falcon_7b")  # and these norms
# An architecture hf_dsinfer has no policy for (to test the unsupported-model path).
UNSUPPORTED = {"xglm": lambda: XGLMConfig(d_model=80, attention_heads=5, num_layers=2, ffn_dim=144,
                                          max_position_embeddings=128, **_COMMON),
               # one the refusal names the lacking features of (Gated DeltaNet)
               "qwen3_next": lambda: Qwen3NextConfig(
                   hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2, **_COMMON),
               # and one whose queries scale with the position (Llama 4's temperature)
               "ministral3": lambda: Ministral3Config(**_LLAMA)}

ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                 "long_factor": [2.0 + i / 8 for i in range(8)],
                 "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def make_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               attn_implementation: str = "eager", rope_scaling: dict | None = None):
    config = {**CONFIGS, **UNSUPPORTED, **MOE_CONFIGS, **MOE_VARIANTS}[name]()
    if rope_scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                             attn_implementation=attn_implementation)
    if name in FAMILIES_2026 or name in MOE_2026:
        _randomize_norms(model, seed)
    if name in MOE_2026 or name == "granite_swa":  # gpt-oss's and the Granite SWAs' sinks
        _randomize_zero_inits(model, seed)
    if name in BIASED:
        _randomize_biases(model, seed)
    if name in LAYER_NORMED:
        _randomize_layer_norms(model, seed)
    if name == "apertus":  # every layer's xIELU starts alike: distinct ones make each count
        gen = torch.Generator().manual_seed(seed + 4)
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.mlp.act_fn.alpha_p, layer.mlp.act_fn.alpha_n):
                    p.add_((0.5 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    return model.eval()


def _randomize_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """HF initializes biases (gpt-oss's expert, attention and router biases) and DeepSeek-V3's
    routing correction bias to zeros: a fused path that dropped one would compute the same.
    Noise makes each of them count; gpt-oss's sinks get unit scale, so they take a visible
    share of every softmax."""
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "sinks")) and tensor.is_floating_point():
                scale = 1.0 if name.endswith("sinks") else 0.1
                noise = scale * torch.randn(tensor.shape, generator=gen)
                tensor.add_(noise.to(tensor.dtype))


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """HF initializes every RMSNorm weight alike (ones, or zeros for Gemma's 1 + w): a block
    that reads the wrong norm, or a norm twice, would compute the same. Distinct weights make
    the families whose norms are their features (sandwich / post-norms, q/k norms) testable."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                noise = 0.2 * torch.randn(module.weight.shape, generator=gen)
                module.weight.add_(noise.to(module.weight.dtype))


def _randomize_layer_norms(model: torch.nn.Module, seed: int) -> None:
    """LayerNorms start at weight 1 (0 for Nemotron's 1 + w) and bias 0: noise on both makes a
    norm read with the wrong numerics (or the wrong norm) count."""
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                for t in (module.weight, module.bias):
                    if t is not None:
                        t.add_((0.2 * torch.randn(t.shape, generator=gen)).to(t.dtype))


def _randomize_biases(model: torch.nn.Module, seed: int) -> None:
    """Zero biases (HF's initialization) would hide a block that drops or misplaces one."""
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                noise = 0.1 * torch.randn(module.bias.shape, generator=gen)
                module.bias.add_(noise.to(module.bias.dtype))


def prompts(batch: int = 3, lengths=(9, 5, 7), seed: int = 1):
    """Left-padded batch of random prompts of different lengths: (input_ids, attention_mask)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths[:batch])
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths[:batch]):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def assert_fp32_matches_hf(ref, fused, atol: float = 1e-4) -> None:
    """An injected fp32 model against its HF original: the left-padded batch's logits within
    atol (inference mode), the same 8 greedy tokens, and fused calls counted during them."""
    import hf_dsinfer

    ids, mask = prompts()
    with torch.inference_mode():
        want, got = ref(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=atol, rtol=0)
    calls = sum(hf_dsinfer.fused_call_counts(fused).values())
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(ids, **kw), ref.generate(ids, **kw))
    assert sum(hf_dsinfer.fused_call_counts(fused).values()) > calls


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over VOCAB ids: <pad>=0, <s>=1, </s>=2, then w3 .. w100."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="w3", padding_side="left")


def save_tiny(tmp_path_factory, name: str) -> str:
    path = tmp_path_factory.mktemp(name)
    make_model(name).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


# Mixture-of-experts models (transformers 5's fused 3-D expert tensors). Kept out of FAMILIES:
# tests/moe covers them, tensor parallelism included (ep x tp in test_ep_tp.py).
_MOE_ATTN = dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
                 num_hidden_layers=2, max_position_embeddings=128, **_COMMON)
MOE_CONFIGS = {
    "mixtral_8x2": lambda: MixtralConfig(**_MOE_ATTN, intermediate_size=56, num_local_experts=8,
                                         num_experts_per_tok=2),
    "mixtral_4x1": lambda: MixtralConfig(**_MOE_ATTN, intermediate_size=56, num_local_experts=4,
                                         num_experts_per_tok=1),
    # layers 0 and 2 sparse (6 experts top-2 + a shared expert), layer 1 dense (mlp_only_layers)
    "qwen2_moe": lambda: Qwen2MoeConfig(**{**_MOE_ATTN, "num_hidden_layers": 3},
                                        num_experts=6, num_experts_per_tok=2,
                                        moe_intermediate_size=40, intermediate_size=96,
                                        shared_expert_intermediate_size=72, mlp_only_layers=[1],
                                        decoder_sparse_step=1, norm_topk_prob=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_MOE_ATTN, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=40, intermediate_size=96,
                                        norm_topk_prob=True),
    "olmoe": lambda: OlmoeConfig(**{**_MOE_ATTN, "num_key_value_heads": 5}, num_experts=8,
                                 num_experts_per_tok=2, intermediate_size=40, clip_qkv=3.0,
                                 norm_topk_prob=False),
    # gpt-oss: sinks, q/k/v/o biases, layers sliding (window 4) / full, 8 experts top-4 with a
    # router bias, biased experts and a SwiGLU limit small enough to clamp
    "gpt_oss": lambda: GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=0.5, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False}, **_COMMON),
    # DeepSeek-V3: MLA (low-rank q, latent 40 + rope 8, interleaved RoPE, yarn's mscale in the
    # softmax scale), layer 0 dense, layer 1 sparse: 8 experts in 4 groups, top-3 within the
    # 2 best groups, a correction bias, routed scaling 2.5, a shared expert. One sparse layer,
    # the last: a bf16 routing near-tie then changes its own token only (bf16 tests skip those)
    "deepseek_v3": lambda: DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        intermediate_size=96, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=40,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 32, "mscale_all_dim": 1.0,
                         "beta_fast": 32.0, "beta_slow": 1.0}, **_COMMON),
}
MOE_CONFIGS["glm4_moe"] = lambda: Glm4MoeConfig(
    # GLM-4.5: q / k / v biases, per-head q / k norms, half of each head rotated; layer 0 dense,
    # layer 1 DeepSeek-V3's MoE (8 experts in 4 groups, top-3 within the 2 best, a correction
    # bias, routed scaling 2.5, a shared expert)
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
    n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    **_COMMON)
_ERNIE_MOE = dict(
    # ERNIE 4.5 MoE: pairs RoPE in fp32; layer 0 dense, layer 1 sparse (8 experts top-3, choice
    # by softmax + a correction bias, a floor on the renormalization, 2 shared experts); the
    # pipeline tests' 4 layers: 0 dense, 1-3 sparse. Two layers, not three: this tiny model
    # amplifies bf16 roundings, and at three its int4 logits at AVX2 torch were 3.4% of their
    # scale from HF's on the dequantized weights (the bound is 3%; two layers: 1.2%).
    # Untied head (ERNIE's default ties it): test_moe_families' dequantized HF copy writes the
    # quantized head's weight, which a tied head would write into the embedding too (tied
    # heads: tests/injection/test_family_quant.py)
    tie_word_embeddings=False, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=3, moe_num_shared_experts=2, moe_layer_start_index=1,
    moe_layer_end_index=3, moe_layer_interval=1, max_position_embeddings=128, **_COMMON)
# without biases, as ERNIE-4.5-21B-A3B ships (MOE_2026's grid)
MOE_CONFIGS["ernie4_5_moe"] = lambda: Ernie4_5_MoeConfig(**_ERNIE_MOE, use_bias=False)
# MoE variants outside the grid, for the tests that name them. With use_bias every projection
# is biased, the shared experts' too, whose down bias tensor parallelism must add once
# (test_ep_tp, test_tp_plans_2026); its random q / k biases make this tiny model amplify bf16
# roundings past the bf16 grid's bounds (a 0.3 logit error against 0.07 without them).
# MiniMax-M2: RMSNorm over the whole q and k projections, half of each head rotated, every
# layer sparse: 8 experts top-3, fp32 sigmoid scores of a bf16 router GEMM, the choice steered
# by a correction bias on the MoE block
MOE_CONFIGS["minimax_m2"] = lambda: MiniMaxM2Config(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=3,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    **_COMMON)
# dots.llm1: Qwen3's per-head q / k norms, sliding / full layers (window 4); layer 0 dense,
# layer 1 DeepSeek-V3's MoE (8 experts in 4 groups, top-3 within the 2 best, a correction bias,
# routed scaling 2.5, a shared expert)
MOE_CONFIGS["dots1"] = lambda: Dots1Config(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
    **_COMMON)
# HunYuan MoE: per-head q / k norms after RoPE, every layer sparse: 8 experts, k per layer
# (3 then 2, HF's list form of moe_topk), softmax top-k renormalized, a shared MLP
MOE_CONFIGS["hunyuan_v1_moe"] = lambda: HunYuanMoEV1Config(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=32, num_experts=8, moe_topk=[3, 2],
    max_position_embeddings=128, **_COMMON)
# FlexOlmo: OLMo 2's post-norms and whole-projection q / k norms, every layer OLMoE's MoE
# (4 experts top-2, renormalized). No norm precedes its MoE, so the router reads the raw
# residual stream; with 8 experts a third of the tokens were bf16 routing near-ties (their
# 2nd and 3rd probabilities within the tests' margin), too many to test anything
MOE_CONFIGS["flex_olmo"] = lambda: FlexOlmoConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=128, **_COMMON)
# Granite MoE: Granite's multipliers, every layer sparse: 6 experts, top-2 of the router's
# logits, then a softmax over those two. With 8 experts a bf16 router-logit tie (two logits
# equal) in layer 0 flipped a token whose change reached the later tokens of its row through
# layer 1's attention (0.06-0.08 of the logits' scale against the int4 test's 0.03)
MOE_CONFIGS["granitemoe"] = lambda: GraniteMoeConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, embedding_multiplier=3.0,
    residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=0.8,
    max_position_embeddings=128, **_COMMON)
# DeepSeek-V2-Lite's layout: MLA with a full-rank q_proj (no q_lora_rank), complex RoPE over
# 8 dims, layer 0 dense, layer 1 sparse: softmax over 8 experts, greedy top-3, routed scaling
# 1.5, a shared expert
_DEEPSEEK_V2 = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
    intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=40, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3,
    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
    max_position_embeddings=128, **_COMMON)
MOE_CONFIGS["deepseek_v2"] = lambda: DeepseekV2Config(**_DEEPSEEK_V2, q_lora_rank=None,
                                                      topk_method="greedy", n_group=1,
                                                      topk_group=1)
# GLM-4.7-Flash: DeepSeek-V3's MLA and MoE (as above) under GLM's names, layer 0 dense by
# mlp_layer_types
MOE_CONFIGS["glm4_moe_lite"] = lambda: Glm4MoeLiteConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
    intermediate_size=96, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=40,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse"],
    max_position_embeddings=128, **_COMMON)
# Solar Open: Llama's attention, every layer GLM-4.5's MoE (8 experts in 4 groups, top-3
# within the 2 best, a correction bias, routed scaling 2.5, a shared expert)
MOE_CONFIGS["solar_open"] = lambda: SolarOpenConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
    max_position_embeddings=128, **_COMMON)
# K-EXAONE: EXAONE 4's attention (per-head q / k norms, sliding (window 4) / full layers, the
# full one NoPE) in a pre-norm block; layer 0 dense, layer 1 DeepSeek-V3's MoE (8 experts in
# 4 groups, top-3 within the 2 best, a correction bias, routed scaling 2.5, a shared expert)
MOE_CONFIGS["exaone_moe"] = lambda: ExaoneMoeConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
    num_shared_experts=1, routed_scaling_factor=2.5, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
    **_COMMON)
# Granite MoE shared: Granite MoE's with a SiLU-gated shared MLP beside the experts. Granite
# MoE SWA: that, plus Granite SWA's sinks, sliding (window 4) / full layers, the full one NoPE
_GRANITE_MOE = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
    num_local_experts=6, num_experts_per_tok=2, embedding_multiplier=3.0,
    residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=0.8,
    shared_intermediate_size=96, max_position_embeddings=128, **_COMMON)
MOE_CONFIGS["granitemoeshared"] = lambda: GraniteMoeSharedConfig(**_GRANITE_MOE,
                                                                 num_hidden_layers=2)
_GRANITEMOE_SWA = lambda: GraniteMoeSWAConfig(  # in MOE_VARIANTS below
    **_GRANITE_MOE, num_hidden_layers=3, sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    layer_rope_theta=[10000.0, 0, 10000.0])
MOE_VARIANTS = {
    # outside the bf16 grid: its three sparse layers of 6 experts meet bf16 router-logit near
    # ties whose flips reach later tokens through attention (0.04-0.2 of the logits' scale
    # on a few tokens the tie exclusion does not mark); fp32 in test_moe_families
    "granitemoe_swa": _GRANITEMOE_SWA,
    # DeepSeek-V2 (236B)'s: a low-rank q, top-3 within the 2 best of 4 groups (each scored by
    # its best probability)
    "deepseek_v2_grouped": lambda: DeepseekV2Config(**_DEEPSEEK_V2, q_lora_rank=32,
                                                    topk_method="group_limited_greedy",
                                                    n_group=4, topk_group=2),
    "ernie4_5_moe_bias": lambda: Ernie4_5_MoeConfig(**_ERNIE_MOE, use_bias=True),
}
MOE_MODELS = list(MOE_CONFIGS)
MOE_2026 = ["gpt_oss", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "minimax_m2", "dots1",
            "hunyuan_v1_moe", "flex_olmo", "granitemoe", "deepseek_v2", "granitemoeshared",
            "glm4_moe_lite", "solar_open", "exaone_moe"]  # the issue-27 MoE families (tests/moe/test_moe_families.py)
