"""Router top-k: which experts each token visits and with what weight, as transformers 5.17 computes
it for each family (``models/{qwen3_moe,qwen2_moe,mixtral,deepseek_v3}/modeling_*.py``):

- ``softmax_topk``: softmax over the router logits in fp32, top-k, optionally renormalized to sum 1
  (Qwen3-MoE / Qwen2-MoE with ``norm_topk_prob``; Mixtral always), the weights cast back to the
  logits' dtype (Qwen) or kept in fp32 (Mixtral);
- ``sigmoid_grouped_topk``: DeepSeek-V3's sigmoid scores, the per-expert correction bias added for
  the choice only, the top ``topk_group`` of ``n_group`` expert groups (each scored by its best two),
  top-k inside them, weights from the uncorrected scores, optionally renormalized, times
  ``routed_scaling_factor``.

Every step is a torch op on the device with static shapes: no host synchronization, capturable in
a CUDA graph, traceable by torch.compile. ``Routing`` describes a router; ``Routing.of(module)``
reads one of transformers' router modules; ``route(logits, routing)`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ShapeError, UnsupportedError, expect

KINDS = ("softmax", "sigmoid_grouped")


@dataclass(frozen=True)
class Routing:
    """How router logits [T, E] become (topk_ids int64 [T, k], topk_weights [T, k]).

    ``weights_dtype``: None keeps the fp32 weights (Mixtral, DeepSeek-V3); 'logits' casts them to
    the logits' dtype (Qwen). The DeepSeek fields are read for kind 'sigmoid_grouped' only
    (``correction_bias`` is a tensor: pass it to ``route``).
    """

    kind: str
    top_k: int
    normalize: bool
    weights_dtype: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UnsupportedError(expect("kind", f"one of {KINDS}", repr(self.kind)))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ShapeError(expect("top_k", "an int >= 1", repr(self.top_k)))
        if self.weights_dtype not in (None, "logits"):
            raise UnsupportedError(expect("weights_dtype", "None or 'logits'", repr(self.weights_dtype)))

    @classmethod
    def of(cls, router) -> Routing:
        """The routing of a transformers router module: ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``,
        ``MixtralTopKRouter``, ``DeepseekV3TopkRouter`` (and classes named like them)."""
        name = type(router).__name__
        if name in ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter"):
            return cls("softmax", int(router.top_k), bool(router.norm_topk_prob), "logits")
        if name == "MixtralTopKRouter":
            return cls("softmax", int(router.top_k), True, None)
        if name == "DeepseekV3TopkRouter":
            return cls("sigmoid_grouped", int(router.top_k), bool(router.norm_topk_prob), None,
                       int(router.num_group), int(router.topk_group), float(router.routed_scaling_factor))
        raise UnsupportedError(expect("router", "Qwen3MoeTopKRouter, Qwen2MoeTopKRouter, MixtralTopKRouter or "
                                      "DeepseekV3TopkRouter", name))


def _check_logits(logits, top_k: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ShapeError(expect("router_logits", "a 2-D tensor [T, E]", getattr(logits, "shape", type(logits).__name__)))
    if not logits.dtype.is_floating_point:
        raise ShapeError(expect("router_logits", "a floating-point tensor", logits.dtype))
    if top_k > logits.shape[1]:
        raise ShapeError(expect("top_k", f"at most E={logits.shape[1]} (router_logits' experts)", top_k))


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, weights_dtype: str | None = None):
    """(topk_ids int64 [T, k], topk_weights [T, k]): Qwen3-MoE / Qwen2-MoE / Mixtral routing."""
    _check_logits(logits, top_k)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return ids, weights


def sigmoid_grouped_topk(logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None,
                         n_group: int, topk_group: int, normalize: bool, routed_scaling_factor: float):
    """(topk_ids int64 [T, k], topk_weights fp32 [T, k]): DeepSeek-V3 routing on fp32 logits."""
    _check_logits(logits, top_k)
    e = logits.shape[1]
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ShapeError(expect("n_group, topk_group", f"n_group dividing E={e} and 1 <= topk_group <= n_group",
                                (n_group, topk_group)))
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def route(logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None):
    """(topk_ids, topk_weights) of router logits [T, E] under ``routing``."""
    if routing.kind == "softmax":
        return softmax_topk(logits, routing.top_k, normalize=routing.normalize, weights_dtype=routing.weights_dtype)
    return sigmoid_grouped_topk(logits, routing.top_k, correction_bias=correction_bias, n_group=routing.n_group,
                                topk_group=routing.topk_group, normalize=routing.normalize,
                                routed_scaling_factor=routing.routed_scaling_factor)
