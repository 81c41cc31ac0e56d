"""Quality measurements for lossy paths: perplexity on a fixed English text shipped with the
package (hf_dsinfer/data/english.txt, written for this project)."""

from __future__ import annotations

import math
from importlib import resources

import torch


def english_text(max_chars: int | None = None) -> str:
    text = resources.files("hf_dsinfer").joinpath("data/english.txt").read_text("utf-8")
    return text if max_chars is None else text[:max_chars]


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, max_tokens: int = 1024) -> float:
    """exp(mean next-token negative log-likelihood) of `text` under `model`, one window."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    ids = ids.to(next(model.parameters()).device)
    logits = model(ids).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            ids[:, 1:].reshape(-1))
    return math.exp(nll.item())
