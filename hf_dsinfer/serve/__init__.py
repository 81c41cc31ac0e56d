"""`hf-dsinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over transformers'
continuous batching on an injected model. See docs/serving.md."""

from hf_dsinfer.serve.app import create_app
from hf_dsinfer.serve.engine import Engine, ServeLimits, greedy_config, sampling_config

__all__ = ["Engine", "ServeLimits", "create_app", "greedy_config", "sampling_config"]
