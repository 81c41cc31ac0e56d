"""The one class-level patch: a `dsinfer=` keyword on `PreTrainedModel.from_pretrained`.

transformers passes unknown from_pretrained kwargs to the model constructor (TypeError), so the
keyword has to be taken out before it gets there. Auto classes and `pipeline(model_kwargs=...)`
all end in `PreTrainedModel.from_pretrained`, so wrapping that one classmethod covers them.
The wrapper turns `dsinfer=` into the registered quantization config; everything else goes
through unchanged. `install()` is idempotent, `uninstall()` restores the original.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PreTrainedModel

from hf_dsinfer.api import init_inference
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.integration.quantizer import DSInferQuantizationConfig

_MARK = "__dsinfer_shim__"


def _load(original, cls, args, kwargs, dsinfer: Any):
    config = DSInferConfig.coerce(dsinfer)
    if config.pp_size > 1:  # each rank reads only its stage (hf_dsinfer.parallel.pipeline_loading)
        from hf_dsinfer.parallel.pipeline_loading import load_pipeline_parallel

        return init_inference(load_pipeline_parallel(original, cls, args, kwargs, config), config)
    if config.tp_size > 1:  # each rank reads only its slices (hf_dsinfer.parallel.loading)
        from hf_dsinfer.parallel.loading import load_tensor_parallel

        return init_inference(load_tensor_parallel(original, cls, args, kwargs, config), config)
    if kwargs.get("gguf_file") is not None or kwargs.get("quantization_config") is not None:
        # transformers refuses a second quantization method next to GGUF / another method:
        # load as the user asked, then inject into the loaded model.
        return init_inference(original(cls, *args, **kwargs), config)
    kwargs["quantization_config"] = DSInferQuantizationConfig.from_dsinfer(config)
    model = original(cls, *args, **kwargs)
    report = get_report(model)
    if report is None or report.config != config:
        # A checkpoint saved with dsinfer carries its own config, which transformers prefers
        # over the caller's; the caller's dsinfer= is the one to honour.
        init_inference(model, config)
    return model


def install() -> None:
    current = PreTrainedModel.__dict__["from_pretrained"]
    if getattr(current.__func__, _MARK, False):
        return
    original = current.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args: Any, dsinfer: Any = None, **kwargs: Any):
        if dsinfer is None or dsinfer is False:
            return original(cls, *args, **kwargs)
        return _load(original, cls, args, kwargs, dsinfer)

    setattr(from_pretrained, _MARK, True)
    from_pretrained.__dsinfer_original__ = current
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def uninstall() -> None:
    current = PreTrainedModel.__dict__["from_pretrained"]
    original = getattr(current.__func__, "__dsinfer_original__", None)
    if original is not None:
        PreTrainedModel.from_pretrained = original


def installed() -> bool:
    return bool(getattr(PreTrainedModel.__dict__["from_pretrained"].__func__, _MARK, False))
