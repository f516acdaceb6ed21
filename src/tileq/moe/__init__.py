"""Mixture-of-experts layers on tileq's grouped GEMMs (docs/moe.md).

    experts = QuantExperts.from_experts(model.model.layers[0].mlp.experts, tileq.FP8BlockConfig())
    y = fused_moe(hidden, (topk_ids, topk_weights), experts)

``routing`` (router top-k as transformers computes it), ``align`` (on-device token sorting),
``experts`` (the quantized weights), ``layer`` (the fused forward and its custom op).
"""

from ..api_moe import MASKED_MAX_ROWS, choose_form
from .align import Alignment, align
from .experts import QuantExperts, experts_refusal
from .layer import fused_moe, fused_moe_ref
from .routing import Routing, route, sigmoid_grouped_topk, softmax_topk
from .spec import ExpertsSpec

__all__ = ["MASKED_MAX_ROWS", "Alignment", "ExpertsSpec", "QuantExperts", "Routing", "align", "choose_form",
           "experts_refusal", "fused_moe", "fused_moe_ref", "route", "sigmoid_grouped_topk", "softmax_topk"]
