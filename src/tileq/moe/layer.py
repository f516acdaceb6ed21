"""``fused_moe``: a mixture-of-experts layer's routed experts in five device steps, capturable in a
CUDA graph and traceable by ``torch.compile(fullgraph=True)`` (the ``tileq::fused_moe`` custom op):

1. route (``routing.py``; or take the model's (topk_ids, topk_weights));
2. quantize each token ONCE (not once per slot);
3. place the T*k (token, expert) slots in expert order with their quantized rows, scales and routing
   weights: masked form on the kernels, ONE launch (``kernels/moe_align.py``, launched through
   ``api_moe.py``: the slots' positions, counts, the row / scale / weight copies); otherwise torch
   ops with static shapes (``align.py``'s sort, then gathers and scatters); one grouped GEMM
   (``tileq.grouped_linear``) computes every expert's gate_up;
4. SiLU·mul, fused with the down projection's activation quantization (``silu_mul_quantize``) for
   configs that quantize activations; one grouped GEMM computes every expert's down projection with
   the routing weights multiplied in its fp32 epilogue (``row_scale``), output in the model's dtype
   (half the bytes of fp32 for the T*k rows; transformers' grouped_mm rounds there too);
5. combine: each token gathers its k rows (the inverse permutation) and sums them over k in fp32 in
   j order, then one cast: deterministic, no atomics (masked form on the kernels: one launch).

At decode (masked form, Triton backend) the routed experts thus take six launches: quantize, align,
gate_up, SiLU·mul·quantize, down, combine (W4A16/W8A16: no quantization; SiLU and mul in torch).

The grouped GEMMs take one of two forms (``choose_form``, decided in ``dispatch/moe.py``): the
contiguous form (rows sorted by expert, ``offsets``) or the masked form (an [E, C, K] buffer with
``counts``, C = T).

Rows of the grouped buffers that belong to no slot are never used: the grouped GEMMs mask every
row at or past counts[e], SiLU·mul works row by row (its rows there are masked off again by the
down GEMM) and the combine reads only slot rows; so their contents (left unwritten) do not matter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import settings
from .._runtime import bounded_put
from ..activation import quantize_activation, silu_mul_quantize
from ..api import linear
from ..api_grouped import grouped_linear
from ..api_moe import choose_form, masked_form_launches
from ..dtypes import PackedInt4
from ..errors import DTypeError, ShapeError, UnsupportedError, expect
from ..ops import plain_trace, tileq_op
from .align import align, check_topk
from .routing import Routing, route
from .spec import ExpertsSpec, spec_of_key

FORMS = ("auto", "contiguous", "masked")


def fused_moe(hidden: Tensor, route_by, experts, *, routing: Routing | None = None,
              correction_bias: Tensor | None = None, form: str = "auto", backend: str | None = None) -> Tensor:
    """sum_j w[t, j] * expert_{id[t, j]}(hidden[t]) for hidden [T, H] (bf16/fp16) -> [T, H].

    ``route_by``: router logits [T, E] (with ``routing``, and ``correction_bias`` for DeepSeek-V3),
    or the pair (topk_ids [T, k] int64/int32, topk_weights [T, k]). ``form``: 'auto'
    (``choose_form``), 'contiguous' or 'masked'. ``backend``: as ``tileq.grouped_linear``'s.
    """
    spec = getattr(experts, "spec", None)
    if not isinstance(spec, ExpertsSpec):
        raise UnsupportedError(expect("experts", "a tileq.moe.QuantExperts", type(experts).__name__))
    _check_hidden(hidden, spec)
    if isinstance(route_by, Tensor):
        if not isinstance(routing, Routing):
            raise UnsupportedError(expect("routing", "a tileq.moe.Routing with router logits",
                                          type(routing).__name__))
        if route_by.dim() != 2 or route_by.shape[1] != spec.e:
            raise ShapeError(expect("router_logits", f"[T, E] with E={spec.e}", tuple(route_by.shape)))
        topk_ids, topk_weights = route(route_by, routing, correction_bias)
    elif isinstance(route_by, (tuple, list)) and len(route_by) == 2:
        topk_ids, topk_weights = route_by
    else:
        raise ShapeError(expect("route_by", "router logits [T, E] or a pair (topk_ids, topk_weights)",
                                type(route_by).__name__))
    check_topk(topk_ids, topk_weights, hidden.shape[0])
    if form not in FORMS:
        raise UnsupportedError(expect("form", f"one of {FORMS}", repr(form)))
    args = (hidden, topk_ids, topk_weights, experts.gate_up_proj, experts.gate_up_proj_scale,
            experts.down_proj, experts.down_proj_scale)
    if torch.compiler.is_compiling():
        return fused_moe_op(*args, spec.key, form, backend or "")
    return moe_forward(*args, spec, form, backend)


def _check_hidden(hidden, spec: ExpertsSpec) -> None:
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[1] != spec.h:
        raise ShapeError(expect("hidden_states", f"a 2-D tensor [T, H] with H={spec.h}",
                                getattr(hidden, "shape", type(hidden).__name__)))
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise DTypeError(expect("hidden_states", "dtype bfloat16 or float16", hidden.dtype))


def moe_forward(hidden, topk_ids, topk_weights, w13, s13, w2, s2, spec: ExpertsSpec, form: str,
                backend: str | None) -> Tensor:
    """The five steps (module docstring) on validated arguments; the custom op's implementation."""
    t, h = hidden.shape
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty((0, h))
    if form == "auto":
        form = choose_form(t, spec.e)[0]
    gemm = {"scheme": spec.scheme, "group_k": spec.group_k, "group_n": spec.group_n, "backend": backend}
    # 2. each token quantized once
    if spec.act_dtype is None:
        xq, xs = hidden, None
    else:
        xq, xs = quantize_activation(hidden, spec.act_dtype, granularity=spec.act_granularity,
                                     group_k=spec.group_k, backend=backend)
    # 3. the slots in expert order, with their rows, scales and routing weights
    kernels = _masked_kernels(hidden, topk_ids, topk_weights, xq, xs, spec, backend) if form == "masked" else None
    if kernels:
        align_launch, combine_launch = kernels
        xg, sg, rs, counts, slot_rows = align_launch(topk_ids, topk_weights, _unit_columns(xq), xs)
        rows, index = (spec.e, t), {"counts": counts}
    else:
        al = align(topk_ids, topk_weights, spec.e, form=form)
        slot_rows = al.slot_rows
        xg = _gather(xq, al.tokens)
        sg = None if xs is None else xs[al.tokens]
        if form == "masked":
            rows, index = (spec.e, al.capacity), {"counts": al.counts}
            xg, sg = _scatter(xg, al.dest, rows), None if sg is None else _scatter(sg, al.dest, rows)
            rs = _scatter(al.weights, al.dest, rows)
        else:
            rows, index = (xg.shape[0],), {"offsets": al.offsets}
            rs = al.weights
    gate_up = grouped_linear(xg, w13, sg, s13, out_dtype=hidden.dtype, **index, **gemm)
    # 4. SiLU·mul (+ the down projection's activation quantization), the down GEMM with row_scale
    if spec.act_dtype is None:
        gate, up = gate_up.chunk(2, dim=-1)
        a, a_s = torch.nn.functional.silu(gate) * up, None
    else:
        a, a_s = silu_mul_quantize(gate_up, spec.act_dtype, granularity=spec.act_granularity,
                                   group_k=spec.group_k, backend=backend)
        a_s = a_s.view(*rows, *a_s.shape[1:])
    y = grouped_linear(a, w2, a_s, s2, out_dtype=hidden.dtype, row_scale=rs, **index, **gemm)
    # 5. combine: gather each token's k rows, sum over k in fp32 (in j order), one cast
    if kernels:
        return combine_launch(y if y.is_contiguous() else y.contiguous(), slot_rows)
    return y.reshape(-1, h)[slot_rows].view(t, k, h).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


# (align launch, combine launch) of the masked form's kernels per call signature, or False where
# the torch ops run; bounded like the other call caches.
_KERNELS: dict = {}
_KERNELS_CAP = 256


def _masked_kernels(hidden, topk_ids, topk_weights, xq, xs, spec: ExpertsSpec, backend):
    """The masked form's align and combine launches for this call, or False for the torch ops
    (``align`` + gathers / scatters): the reference backend, or more than ``MAX_SLOTS`` slots."""
    key = (hidden.shape, hidden.stride(), hidden.dtype, hidden.device, topk_ids.shape, topk_ids.stride(),
           topk_ids.dtype, topk_weights.stride(), topk_weights.dtype, spec, backend, settings.key())
    hit = _KERNELS.get(key)
    if hit is None:  # (the torch ops are cached as False: None is a miss)
        hit = masked_form_launches(hidden, topk_ids, topk_weights, _unit_columns(xq), xs, spec.e, backend) or False
        bounded_put(_KERNELS, key, hit, _KERNELS_CAP)
    return hit


def _unit_columns(x: Tensor) -> Tensor:
    """x itself when its columns are contiguous (the kernel reads rows of any stride), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _gather(src: Tensor, index: Tensor) -> Tensor:
    """src's rows at ``index``; float8 moved as bytes (the same bits, whatever the indexing
    kernels support for float8)."""
    if src.dtype in _FLOAT8:
        return src.view(torch.uint8)[index].view(src.dtype)
    return src[index]


def _scatter(src: Tensor, dest: Tensor, rows: tuple) -> Tensor:
    """src's rows placed at flat rows ``dest`` of a zero [E * C, ...] buffer, viewed [E, C, ...]."""
    raw = src.view(torch.uint8) if src.dtype in _FLOAT8 else src
    buf = raw.new_zeros((rows[0] * rows[1], *src.shape[1:]))
    buf[dest] = raw
    return buf.view(src.dtype).view(*rows, *src.shape[1:])


def _fused_moe_trace(*args):
    """The plain traced call, its executor the op's ``backend`` argument's ('' the default)."""
    return plain_trace(fused_moe_op.impl, *args, backend=args[-1] or None)


@tileq_op("fused_moe", trace=_fused_moe_trace, checks=True)
def fused_moe_op(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
                 gate_up_proj_scale: Tensor, down_proj: Tensor, down_proj_scale: Tensor, spec: str, form: str,
                 backend: str) -> Tensor:
    """``fused_moe`` on (topk_ids, topk_weights); ``spec`` is the experts' ``ExpertsSpec.key``,
    ``backend`` '' for the default. Registered at the dispatcher directly (``ops.TileqOp``), as
    the dense layers' ops: ``torch.library.custom_op``'s Python wrapper adds host time to every
    call, and a compiled graph calls it once per MoE layer."""
    return moe_forward(hidden, topk_ids, topk_weights, gate_up_proj, gate_up_proj_scale, down_proj,
                       down_proj_scale, spec_of_key(spec), form, backend or None)


@fused_moe_op.register_fake
def _fused_moe_fake(hidden, topk_ids, topk_weights, gate_up_proj, gate_up_proj_scale, down_proj,
                    down_proj_scale, spec, form, backend):
    return hidden.new_empty(hidden.shape)


# ----------------------------------------------------------------------------- reference


def fused_moe_ref(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts) -> Tensor:
    """The same function computed slot by slot with ``tileq.linear``'s reference on each expert's
    weight (no sorting, no grouped GEMM): a test oracle. Synchronizes; small sizes only."""
    spec = experts.spec
    t, h = hidden.shape
    k = topk_ids.shape[1]
    out = torch.zeros(t, k, h, dtype=hidden.dtype, device=hidden.device)
    for tok in range(t):
        x = hidden[tok:tok + 1]
        if spec.act_dtype is not None:
            x, xs = quantize_activation(x, spec.act_dtype, granularity=spec.act_granularity,
                                        group_k=spec.group_k, backend="reference")
        else:
            xs = None
        for j in range(k):
            e = int(topk_ids[tok, j])
            gu = _expert_linear(x, xs, experts, "gate_up_proj", e, hidden.dtype)
            if spec.act_dtype is None:
                g, u = gu.chunk(2, dim=-1)
                a, a_s = torch.nn.functional.silu(g) * u, None
            else:
                a, a_s = silu_mul_quantize(gu, spec.act_dtype, granularity=spec.act_granularity,
                                           group_k=spec.group_k, backend="reference")
            y = _expert_linear(a, a_s, experts, "down_proj", e, torch.float32)
            out[tok, j] = (y[0] * topk_weights[tok, j].float()).to(hidden.dtype)  # the epilogue's cast
    return out.sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def _expert_linear(x, xs, experts, name: str, e: int, out_dtype):
    spec = experts.spec
    w = getattr(experts, name)[e]
    s = getattr(experts, name + "_scale")[e]
    if spec.weight_dtype == "int4":
        w = PackedInt4(w, (w.shape[0], 2 * w.shape[1]), 1)
    return linear(x, w, xs, s.t() if s.dim() == 2 else s, scheme=spec.scheme, out_dtype=out_dtype,
                  group_k=spec.group_k, group_n=spec.group_n, backend="reference")
