"""hf_dsinfer: DeepSpeed-Inference, DeepSpeed-MoE and FlexGen inference for HF Transformers.

    import hf_dsinfer                         # registers `dsinfer=` with from_pretrained
    model = AutoModelForCausalLM.from_pretrained(path, dsinfer=True)
    model = hf_dsinfer.init_inference(model, hf_dsinfer.DSInferConfig(dtype=torch.bfloat16))
    print(hf_dsinfer.explain(model))
"""

from hf_dsinfer import integration as _integration
from hf_dsinfer.api import explain, fused_call_counts, init_inference, revert
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.errors import (
    ContinuousBatchingError,
    DSInferConfigError,
    DSInferError,
    ParityError,
    UnsupportedModelError,
)
from hf_dsinfer.injection.policies import supported_families

_integration.activate()

__version__ = "0.1.0"
__all__ = [
    "ContinuousBatchingError",
    "DSInferConfig",
    "DSInferConfigError",
    "DSInferError",
    "ParityError",
    "UnsupportedModelError",
    "explain",
    "fused_call_counts",
    "init_inference",
    "revert",
    "supported_families",
]
