"""The MoE layer's calls into the floors below the model layer (``moe/layer.py`` makes them): the
grouped GEMMs' form (decided in ``dispatch/moe.py``) and the masked form's one-launch preparation
and combine (``kernels/moe_align.py``) for a call signature."""

from __future__ import annotations

from .dispatch.moe import MASKED_MAX_ROWS, choose_form
from .dispatch.pdl import pdl_enabled
from .dispatch.plan import resolve_backend
from .kernels import moe_align

__all__ = ["MASKED_MAX_ROWS", "choose_form", "masked_form_launches"]


def masked_form_launches(hidden, topk_ids, topk_weights, x, xs, num_experts: int, backend):
    """(align launch, combine launch) of the masked form for this call: ``hidden`` [T, H], the
    routing [T, k], ``x`` the rows the experts read [T, K] (unit column stride) and ``xs`` their
    scales or None. None where the torch ops run instead: the reference backend, or more than
    ``MAX_SLOTS`` slots."""
    t, k = topk_ids.shape
    executor, interpreted = resolve_backend(backend, hidden.device)
    # A size route, not a fallback: choose_form's masked form always fits (E x T <= MASKED_MAX_ROWS
    # and k <= E give T*k <= 4096 = MAX_SLOTS); only a caller-forced masked form at more slots
    # takes the torch ops, which handle any size.
    if executor != "triton" or t * k > moe_align.MAX_SLOTS:
        return None
    h = hidden.shape[1]
    pdl = pdl_enabled(hidden.device, interpreted)
    align_launch = moe_align.MoeAlignLaunch(
        t=t, topk=k, e=num_experts, c=t, k_dim=x.shape[1], device=hidden.device, ids_dtype=topk_ids.dtype,
        ids_strides=topk_ids.stride(), w_dtype=topk_weights.dtype, w_strides=topk_weights.stride(),
        x_dtype=x.dtype, x_stride=x.stride(0), xs_shape=None if xs is None else tuple(xs.shape),
        xs_strides=None if xs is None else xs.stride(), interpreted=interpreted, pdl=pdl)
    combine_launch = moe_align.MoeCombineLaunch(
        t=t, topk=k, rows=num_experts * t, h=h, y_stride=h, y_dtype=hidden.dtype, out_dtype=hidden.dtype,
        device=hidden.device, interpreted=interpreted, pdl=pdl)
    return align_launch, combine_launch
