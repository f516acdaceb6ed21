"""The MoE layer's masked-form preparation and its combine, one launch each: the kernels, their
launchers and their torch references.

A token t visits k experts; its slots are s = t * k + j (row t, column j of topk_ids [T, k]).
``_moe_align_kernel`` places every slot in an [E, C, ...] buffer at flat row

    dest(s) = e * C + (number of slots s' < s with the same expert e),

the stable order of ``tileq.moe.align(..., form="masked")`` (which sorts), and in the same launch
copies the token's row x[t] to xg[dest(s)], its scales xs[t] to sg[dest(s)], the routing weight
(as fp32) to rs[dest(s)], writes slot_rows[s] = dest(s) (int32) and counts[e] (int32). Program p
< S handles slot p: it loads all S ids (one block; S <= MAX_SLOTS) and counts the earlier equal
ones; program p < E counts expert p. No sort, no atomics, no host synchronization.

Rows of xg / sg / rs that belong to no slot are left unwritten (fresh torch.empty buffers). Nothing
reads them: the masked grouped kernel (kernels/grouped/kernel.py, ``_tile_rows``) ends expert e's
rows at min(counts[e], C), masks every x, x-scale and row-scale load with ``rm < end`` and stores
no output row past it; SiLU·mul between the two GEMMs works row by row, so a garbage row only
yields a garbage row that the down GEMM does not read either; the combine reads only slot_rows.

``_moe_combine_kernel`` computes out[t] = cast(sum_j float32(y[slot_rows[t * k + j]])), the adds in
j order in fp32 (one program per token and column block: deterministic).

Contract as ``align``'s (not checked: it would synchronize): ids in [0, E), no expert above C
slots. Outside it nothing is written or read out of bounds: a slot whose id is out of range or whose
position is >= C moves no data, and the combine adds 0 for a slot row outside y.

Rows move in their own dtype (float8 as uint8 bytes: the same bits, and no float8 conversion in
the interpreter); the scales and routing weights are converted to fp32.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from ..errors import ShapeError, UnsupportedError, expect
from .act_quant_kernel import _round_to, _to_f32
from .direct import KernelCall, direct_launch_enabled
from .pdl import wait_upstream

_THIS = sys.modules[__name__]  # KernelCall looks the kernels up here at call time

# One program loads every slot's id as one block: beyond this the quadratic count would cost
# more than a sort. The masked form (E x T <= MOE_MASKED_MAX_ROWS = 4096, k <= E) stays below.
MAX_SLOTS = 4096
ROW_CHUNK = 2048  # elements of a row copied per step (7168-wide rows in 4 steps)
COMBINE_BLOCK = 1024  # output columns per combine program
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8) + _FLOAT8
_OUT_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pdl_kwargs(pdl: bool) -> dict:
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _moe_align_kernel(
    ids_ptr, w_ptr, x_ptr, xs_ptr, xg_ptr, sg_ptr, rs_ptr, counts_ptr, slot_rows_ptr,
    S, E, C, K, G, stride_it, stride_ij, stride_wt, stride_wj, stride_xm, stride_xsm, stride_xsg,
    TOPK: tl.constexpr, S_POW2: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_SCALES: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (max(S, E),): program p < S places slot p, program p < E writes counts[p]. xg is
    contiguous [E * C, K], sg [E * C, G], rs [E * C]."""
    if PDL:
        wait_upstream()  # ids, weights, x and xs come from upstream kernels; outputs may be scratch
    p = tl.program_id(0)
    offs = tl.arange(0, S_POW2)
    live = offs < S
    ids = tl.load(ids_ptr + (offs // TOPK) * stride_it + (offs % TOPK) * stride_ij, mask=live, other=-1)
    ids = ids.to(tl.int32)
    if p < S:
        t = p // TOPK
        j = p % TOPK
        e = tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int32)
        pos = tl.sum(((ids == e) & (offs < p)).to(tl.int32), 0)
        dest = e.to(tl.int64) * C + pos
        tl.store(slot_rows_ptr + p, dest.to(tl.int32))
        if (e >= 0) & (e < E) & (pos < C):
            wt = _to_f32(tl.load(w_ptr + t * stride_wt + j * stride_wj), INTERPRETED)
            tl.store(rs_ptr + dest, wt)
            src = x_ptr + t.to(tl.int64) * stride_xm
            dst = xg_ptr + dest * K
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                ok = kk < K
                tl.store(dst + kk, tl.load(src + kk, mask=ok), mask=ok)
            if HAS_SCALES:
                g = tl.arange(0, BLOCK_G)
                gok = g < G
                s = tl.load(xs_ptr + t.to(tl.int64) * stride_xsm + g * stride_xsg, mask=gok)
                tl.store(sg_ptr + dest * G + g, s, mask=gok)
    if p < E:
        tl.store(counts_ptr + p, tl.sum(((ids == p) & live).to(tl.int32), 0))


@triton.jit
def _moe_combine_kernel(
    y_ptr, slot_rows_ptr, out_ptr, ROWS, H, stride_ym, stride_om,
    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, OUT_TYPE: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (T, cdiv(H, BLOCK_H)): out[t, cols] = cast(sum over j in order of fp32 y rows)."""
    if PDL:
        wait_upstream()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(slot_rows_ptr + t * TOPK + j).to(tl.int64)
        inside = (r >= 0) & (r < ROWS)
        v = tl.load(y_ptr + r * stride_ym + cols, mask=ok & inside, other=0.0)
        acc = acc + _to_f32(v, INTERPRETED)
    tl.store(out_ptr + t * stride_om + cols, _round_to(acc, OUT_TYPE, INTERPRETED), mask=ok)


# ----------------------------------------------------------------------------- launchers


class MoeAlignLaunch:
    """The masked-form preparation for one call signature: topk_ids / topk_weights [T, k] (any
    strides), x rows [T, K] (unit column stride, row stride ``x_stride``), optional fp32 scales xs
    [T] or [T, G] (strides ``xs_strides``); E experts, capacity C. ``__call__`` returns
    (xg [E, C, K], sg [E, C] / [E, C, G] or None, rs fp32 [E, C], counts int32 [E],
    slot_rows int32 [T * k])."""

    __slots__ = ("c", "call", "device", "direct", "e", "k_dim", "ptr_dtypes", "s_tail", "slots", "x_dtype")

    def __init__(self, *, t: int, topk: int, e: int, c: int, k_dim: int, device, ids_dtype, ids_strides,
                 w_dtype, w_strides, x_dtype, x_stride: int, xs_shape=None, xs_strides=None,
                 interpreted: bool, pdl: bool):
        s = t * topk
        if s > MAX_SLOTS:
            raise UnsupportedError(expect("topk_ids", f"at most {MAX_SLOTS} slots T*k for the one-launch "
                                          "masked-form preparation", f"T*k = {s}"))
        if x_dtype not in _ROW_DTYPES:
            raise UnsupportedError(expect("x", f"a dtype in {_ROW_DTYPES}", x_dtype))
        has_scales = xs_shape is not None
        if has_scales and len(xs_shape) not in (1, 2):
            raise ShapeError(expect("xs", "per-token scales [T] or [T, G]", tuple(xs_shape)))
        g = (xs_shape[1] if len(xs_shape) == 2 else 1) if has_scales else 0
        self.e, self.c, self.k_dim, self.x_dtype, self.slots = e, c, k_dim, x_dtype, s
        self.s_tail = tuple(xs_shape[1:]) if has_scales else None
        self.device = device
        row_dtype = torch.uint8 if x_dtype in _FLOAT8 else x_dtype
        consts = dict(TOPK=topk, S_POW2=_pow2_ceil(max(s, 1)), BLOCK_K=min(_pow2_ceil(max(k_dim, 1)), ROW_CHUNK),
                      BLOCK_G=_pow2_ceil(max(g, 1)), HAS_SCALES=has_scales, INTERPRETED=interpreted,
                      num_warps=4, num_stages=1, **_pdl_kwargs(pdl))
        xs_m, xs_g = (xs_strides[0], xs_strides[1] if g and len(xs_strides) == 2 else 0) if has_scales else (0, 0)
        ints = (s, e, c, k_dim, g, ids_strides[0], ids_strides[1], w_strides[0], w_strides[1], x_stride, xs_m, xs_g)
        self.ptr_dtypes = (ids_dtype, w_dtype, row_dtype, torch.float32 if has_scales else None, row_dtype,
                           torch.float32 if has_scales else None, torch.float32, torch.int32, torch.int32)
        self.call = KernelCall(_THIS, "_moe_align_kernel", (max(s, e),), ints, consts, self.ptr_dtypes)
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, topk_ids, topk_weights, x, xs=None):
        e, c, dev = self.e, self.c, self.device
        float8 = self.x_dtype in _FLOAT8
        xg = torch.empty((e, c, self.k_dim), dtype=self.x_dtype, device=dev)
        sg = None if self.s_tail is None else torch.empty((e, c, *self.s_tail), dtype=torch.float32, device=dev)
        rs = torch.empty((e, c), dtype=torch.float32, device=dev)
        counts = torch.empty((e,), dtype=torch.int32, device=dev)
        slot_rows = torch.empty((self.slots,), dtype=torch.int32, device=dev)
        ptrs = (topk_ids, topk_weights, x.view(torch.uint8) if float8 else x, xs,
                xg.view(torch.uint8) if float8 else xg, sg, rs, counts, slot_rows)
        self.call(ptrs, self.direct and direct_launch_enabled())
        return xg, sg, rs, counts, slot_rows


class MoeCombineLaunch:
    """The combine for one call signature: y [E, C, H] (or any [rows, H] view, row stride
    ``y_stride``, unit column stride) and slot_rows int32 [T * k] -> out [T, H] in ``out_dtype``."""

    __slots__ = ("call", "device", "direct", "out_dtype", "out_shape", "ptr_dtypes")

    def __init__(self, *, t: int, topk: int, rows: int, h: int, y_stride: int, y_dtype, out_dtype, device,
                 interpreted: bool, pdl: bool):
        if y_dtype not in _OUT_TYPES or out_dtype not in _OUT_TYPES:
            raise UnsupportedError(expect("y, out_dtype", f"dtypes in {tuple(_OUT_TYPES)}", (y_dtype, out_dtype)))
        block = min(_pow2_ceil(max(h, 1)), COMBINE_BLOCK)
        consts = dict(TOPK=topk, BLOCK_H=block, OUT_TYPE=_OUT_TYPES[out_dtype], INTERPRETED=interpreted,
                      num_warps=4, num_stages=1, **_pdl_kwargs(pdl))
        self.out_shape, self.out_dtype, self.device = (t, h), out_dtype, device
        ints = (rows, h, y_stride, h)
        self.ptr_dtypes = (y_dtype, torch.int32, out_dtype)
        self.call = KernelCall(_THIS, "_moe_combine_kernel", (t, triton.cdiv(h, block)), ints, consts,
                               self.ptr_dtypes)
        self.direct = device.type == "cuda" and not interpreted

    def __call__(self, y, slot_rows):
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        self.call((y, slot_rows, out), self.direct and direct_launch_enabled())
        return out


# ----------------------------------------------------------------------------- references


def moe_align_ref(topk_ids, topk_weights, x, xs, num_experts: int, capacity: int):
    """The align kernel's function in torch (a one-hot prefix count, no sort): (xg, sg, rs, counts,
    slot_rows int32) with the rows that belong to no slot zero. Assumes the contract (ids in
    [0, E), at most C slots per expert)."""
    flat = topk_ids.reshape(-1).long()
    s, e, c = flat.numel(), num_experts, capacity
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    onehot = (flat[:, None] == torch.arange(e, device=flat.device)).long()  # [S, E]
    pos = (onehot.cumsum(0) - onehot).gather(1, flat[:, None]).reshape(-1) if s else flat
    dest = flat * c + pos
    tokens = torch.arange(s, device=flat.device) // k

    def place(src):
        buf = src.new_zeros((e * c, *src.shape[1:]))
        buf[dest] = src
        return buf.view(e, c, *src.shape[1:])

    raw = x.view(torch.uint8) if x.dtype in _FLOAT8 else x
    xg = place(raw[tokens]).view(x.dtype)
    sg = None if xs is None else place(xs.float()[tokens])
    rs = place(topk_weights.reshape(-1).float())
    return xg, sg, rs, onehot.sum(0).to(torch.int32), dest.to(torch.int32)


def moe_combine_ref(y, slot_rows, tokens: int, topk: int, out_dtype):
    """out[t] = cast(sum over j in order of fp32 rows y[slot_rows[t * k + j]]): the kernel's adds."""
    rows = y.reshape(-1, y.shape[-1])[slot_rows.long()].view(tokens, topk, -1).float()
    acc = torch.zeros(tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    for j in range(topk):
        acc = acc + rows[:, j]
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------- AOT builds

_TRITON_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
               torch.int8: "*i8", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


def aot_source(launch):
    """(ASTSource, options) to ``triton.compile`` what ``launch`` runs on any machine (Triton not
    in interpreter mode); pointers and integer arguments that are multiples of 16 are marked
    aligned as the JIT marks them."""
    call = launch.call
    fn = getattr(_THIS, call.name)
    names = [p.name for p in fn.params]
    ptr_dtypes = launch.ptr_dtypes
    sig, consts, aligned = {}, {}, []
    for name, dt in zip(names, ptr_dtypes):
        sig[name] = "constexpr" if dt is None else _TRITON_PTR[dt]
        if dt is None:
            consts[name] = None
        else:
            aligned.append(name)
    for name, v in zip(names[len(ptr_dtypes):], call.ints):
        sig[name] = "i32"
        if v % 16 == 0:
            aligned.append(name)
    options = {k: v for k, v in call.kwargs.items() if k in ("num_warps", "num_stages", "launch_pdl")}
    for name, v in call.kwargs.items():
        if name not in options:
            sig[name], consts[name] = "constexpr", v
    order = list(sig)
    attrs = {(order.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), options

