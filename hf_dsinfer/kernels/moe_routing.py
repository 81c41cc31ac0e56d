"""Routing beyond softmax top-k: DeepSeek-V3's sigmoid, group-limited top-k with a correction
bias (also MiniMax-M2's, with one group), ERNIE 4.5's biased softmax (kernels/moe.py's
topk_gating covers the plain softmax routers).

sigmoid_group_topk(logits [T, E], correction_bias [E], top_k, n_group, topk_group,
                   renormalize, scaling) -> (weights [T, k] fp32, ids [T, k] int64)
    (logits fp32, or the activations' dtype: they are scored in fp32 either way)
    scores = sigmoid(logits); the *choice* uses scores + correction_bias (a load-balancing bias
    that steers which experts are picked but not their weights): the experts are split into
    n_group groups, each group scored by the sum of its two best choice scores, the topk_group
    best groups kept, and the top_k experts chosen among them. Weights are the chosen experts'
    plain sigmoid scores, divided by their sum (+1e-20) when `renormalize`, times `scaling`
    (routed_scaling_factor). HF's DeepseekV3TopkRouter op for op, ids in torch.topk's unsorted
    order as HF takes them.
softmax_biased_topk(logits [T, E] fp32, correction_bias [E] or [1, E], top_k, norm_min)
    ERNIE 4.5's router: probs = softmax(logits) in fp32; the choice is torch.topk of probs +
    correction_bias (sorted, as HF calls it); weights are the chosen plain probabilities divided
    by max(their sum, norm_min). The caller casts them to the activations' dtype, as HF does.
softmax_group_topk(logits [T, E] fp32, top_k, n_group, topk_group, scaling)
    DeepSeek-V2's router: probs = softmax(logits) in fp32; with n_group > 1
    ("group_limited_greedy") each group scored by its best probability, the experts outside the
    topk_group best groups zeroed, then torch.topk (unsorted, as HF) of what is left; weights
    are the chosen probabilities times `scaling`, not renormalized.
softmax_biased_margin(...) -> [T]
    the gap between the k-th and the next biased choice score.
selection_margin(...) -> [T]
    how far each token is from another choice: the smaller of the gap between the topk_group-th
    and the next group score and the gap between the k-th and the next choice score inside the
    kept groups. A tie there may legally flip under other rounding (the parity gate skips it).
"""

from __future__ import annotations

import torch


def _group_scores(choice: torch.Tensor, n_group: int, best: int = 2) -> torch.Tensor:
    """[T, E] -> [T, n_group]: each group's `best` best choice scores, summed (DeepSeek-V3:
    two; DeepSeek-V2: its best one)."""
    t, e = choice.shape
    return choice.view(t, n_group, e // n_group).topk(best, dim=-1)[0].sum(dim=-1)


def _masked_choice(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                   fill: float = float("-inf")) -> torch.Tensor:
    """Choice scores with the experts outside the topk_group best groups at `fill`."""
    t, e = choice.shape
    n_group = group_scores.shape[1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, n_group]
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    return choice.masked_fill(~score_mask.bool(), fill)


def sigmoid_group_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                       n_group: int, topk_group: int, renormalize: bool, scaling: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float().sigmoid()  # [T, E]; fp32 (MiniMax-M2's router GEMM is bf16)
    choice = scores + correction_bias
    if n_group > 1:  # MiniMax-M2: one group, every expert eligible
        choice = _masked_choice(choice, _group_scores(choice, n_group), topk_group)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def softmax_biased_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                        norm_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=1, dtype=torch.float32)  # [T, E]
    ids = torch.topk(probs + correction_bias.squeeze(), top_k, dim=-1)[1]  # [T, k]
    weights = torch.gather(probs, dim=-1, index=ids)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=norm_min), ids


def softmax_group_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if n_group > 1:  # group_limited_greedy: the others zeroed, as HF's masked_fill(0.0)
        scores = _masked_choice(scores, _group_scores(scores, n_group, best=1), topk_group, 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, ids


def softmax_biased_margin(logits: torch.Tensor, correction_bias: torch.Tensor,
                          top_k: int) -> torch.Tensor:
    choice = torch.softmax(logits.float(), dim=-1) + correction_bias.squeeze()
    if top_k >= choice.shape[-1]:
        return torch.ones(logits.shape[0], device=logits.device)
    top = torch.topk(choice, top_k + 1, dim=-1).values
    return top[:, top_k - 1] - top[:, top_k]


def selection_margin(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                     n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's sigmoid choice (correction_bias given) or DeepSeek-V2's softmax one
    (None: groups scored by their best probability)."""
    if correction_bias is None:
        choice, best = torch.softmax(logits.float(), dim=-1), 1
    else:
        choice, best = logits.float().sigmoid() + correction_bias, 2
    groups = _group_scores(choice, n_group, best)  # [T, n_group]
    margins = []
    if topk_group < n_group:
        top = torch.topk(groups, topk_group + 1, dim=-1).values
        margins.append(top[:, -2] - top[:, -1])
    kept = _masked_choice(choice, groups, topk_group)
    if top_k < torch.isfinite(kept).sum(dim=-1).min():
        top = torch.topk(kept, top_k + 1, dim=-1).values
        margins.append(top[:, -2] - top[:, -1])
    if not margins:
        return torch.ones(logits.shape[0], device=logits.device)
    return torch.stack(margins).min(dim=0).values
