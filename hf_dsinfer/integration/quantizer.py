"""The "dsinfer" quantization method: transformers' official per-call hook into from_pretrained.

`from_pretrained(..., quantization_config=DSInferQuantizationConfig(...))` (which the `dsinfer=`
shim builds) makes transformers call our quantizer twice: before the weights load (the model is
on meta: we refuse an unsupported architecture before reading gigabytes) and after (we inject).
The config is saved into config.json, so a reload with hf_dsinfer imported re-applies it; without
hf_dsinfer, transformers warns about the unknown method and loads the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import UnsupportedModelError
from hf_dsinfer.injection.policies import find_policy, supported_families
from hf_dsinfer.phases import inject

METHOD = "dsinfer"


class DSInferQuantizationConfig(QuantizationConfigMixin):
    """A DSInferConfig in the shape transformers stores in `config.quantization_config`."""

    def __init__(self, quant_method: str = METHOD, **options: Any):
        self.quant_method = quant_method
        self.options = DSInferConfig.from_dict(options).to_dict()

    @classmethod
    def from_dsinfer(cls, config: DSInferConfig) -> DSInferQuantizationConfig:
        return cls(**config.to_dict())

    @property
    def dsinfer_config(self) -> DSInferConfig:
        return DSInferConfig.from_dict(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **self.options}


class DSInferQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: DSInferQuantizationConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self.dsinfer = quantization_config.dsinfer_config

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        return self.dsinfer.dtype or dtype

    def update_device_map(self, device_map: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.dsinfer.offload is None:
            return device_map
        # Offload places the weights itself: a dict filled in once the model exists (below), so
        # transformers leaves the decoder layers in the checkpoint instead of loading them.
        self._offload_map: dict[str, Any] = {}
        return self._offload_map

    def _fill_offload_map(self, model) -> None:
        from hf_dsinfer.offload.attach import loading_device_map

        self._offload_map.clear()
        self._offload_map.update(loading_device_map(model, self.dsinfer.offload))

    def _process_model_before_weight_loading(self, model, **kwargs):
        if find_policy(model) is None and self.dsinfer.strict is not False:
            raise UnsupportedModelError(
                f"hf_dsinfer has no injection policy for {type(model).__name__} "
                f"(config.model_type={model.config.model_type!r}); supported families: "
                f"{sorted(supported_families())}. Fix: use a supported model, or pass "
                "dsinfer={'strict': False} to load it unmodified."
            )
        if self.dsinfer.offload is not None and hasattr(self, "_offload_map"):
            self._fill_offload_map(model)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        # Without `quant`, injection swaps forwards but keeps the weights' format: keep
        # .to(dtype), .half() etc. working (transformers blocks them on quantized models).
        quantized = self.dsinfer.quant is not None
        model.is_quantized = quantized
        model.config._is_quantized = quantized
        inject(model, self.dsinfer)
        return model

    def is_serializable(self) -> bool:
        # Quantized blocks hold packed buffers that transformers cannot load back; the config is
        # re-applied at load instead (save the model before quantizing, or without `quant`).
        return self.dsinfer.quant is None

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register the method with transformers once (re-registering raises there)."""
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(DSInferQuantizationConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(DSInferQuantizer)
