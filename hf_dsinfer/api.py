"""Public entry points: init_inference, revert, explain."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_dsinfer import phases
from hf_dsinfer.config import DSInferConfig
from hf_dsinfer.injection import walker
from hf_dsinfer.injection.explain import explain


def init_inference(model: nn.Module, config: DSInferConfig | dict | bool | None = None,
                   **overrides: Any) -> nn.Module:
    """Inject fused blocks into an already-loaded HF model, in place; returns the same object.

    `config` is a DSInferConfig, a dict of its fields, True or None (defaults); keyword
    overrides replace single fields: `init_inference(model, dtype=torch.bfloat16)`.
    The model is put in eval mode (fused blocks are inference-only; in train mode they defer
    to the HF forward).
    """
    cfg = DSInferConfig.coerce(config)
    if overrides:
        cfg = cfg.replace(**overrides)
    if cfg.dtype is not None:
        model.to(cfg.dtype)
    model.eval()
    phases.inject(model, cfg)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo init_inference: every block gets its HF forward back. Returns the same object."""
    return phases.revert(model)


def fused_call_counts(model: nn.Module) -> dict[str, int]:
    """Fused-forward calls per block path, and per fused MoE path (`...layers.N.mlp`): proof
    that the fused path ran."""
    report = walker.get_report(model)
    if report is None:
        return {}
    return {p: f.calls for p, f in (*report.blocks.items(), *report.moe.items())}


__all__ = ["explain", "fused_call_counts", "init_inference", "revert"]
