"""Launch the grouped kernel for a (GroupedSpec, GroupedConfig), and build it ahead of time.

``GroupedLaunch`` fixes everything that does not depend on where the data lives (grid, integer
arguments, constexprs) once per call signature; a call then allocates the output (unless given)
and launches. Nothing is read from the device: the grid comes from shapes alone, so a launch is
capturable in a CUDA graph and replays correctly with new offsets / counts.
"""

from __future__ import annotations

import sys

import torch

from ...problem import ScaleKind
from ..direct import KernelCall, direct_launch_enabled
from .kernel import _grouped_kernel
from .spec import GroupedConfig, GroupedSpec

_THIS = sys.modules[__name__]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def grid(spec: GroupedSpec, cfg: GroupedConfig) -> tuple[int, int]:
    """(row tiles, column tiles): E x cdiv(C, BM) (masked) or cdiv(T, BM) + min(E, T)
    (contiguous): sum_e cdiv(rows_e, BM) <= T / BM + (experts with rows), and at most min(E, T)
    experts have rows, so decode (T of a few tokens) launches a few row tiles, not E."""
    if spec.form == "masked":
        m = spec.e * _cdiv(spec.rows, cfg.block_m)
    else:
        m = _cdiv(spec.rows, cfg.block_m) + min(spec.e, spec.rows)
    return m, _cdiv(spec.n, cfg.block_n)


def constexprs(spec: GroupedSpec, cfg: GroupedConfig, interpreted: bool = False) -> dict:
    """The kernel's constexpr arguments: the one mapping the launcher and the AOT build share."""
    x_ct, w_ct = spec.mma_types()
    return {
        "FORM": spec.form, "E_POW2": _pow2_at_least(max(spec.e, 2)) if spec.form == "contiguous" else 1,
        "X_TYPE": spec.x_type.value, "W_TYPE": spec.w_type.value, "X_CT": x_ct.value, "W_CT": w_ct.value,
        "X_SCALE": spec.x_scale.value, "W_SCALE": spec.w_scale.value,
        # Constant when unused so unrelated values never cause a recompile.
        "GROUP_K": spec.group_k if spec.grouped else 1, "GROUP_N": spec.group_n if spec.grouped else 1,
        "INT_DOT": spec.integer_mainloop, "GROUPED": spec.grouped, "HAS_ROW_SCALE": spec.has_row_scale,
        "BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k, "SWAPPED": cfg.swap_ab,
        "EVEN_K": spec.k % cfg.block_k == 0, "INTERPRETED": interpreted,
        "GROUP_M": cfg.group_m,
    }


def launch_grid(spec: GroupedSpec, cfg: GroupedConfig) -> tuple[int]:
    """(tiles,): the kernel numbers the row x column tiles along one axis (grouped launch order)."""
    m, n = grid(spec, cfg)
    return (m * n,)


def _rows_strides(t, masked: bool) -> tuple[int, int]:
    """(stride per expert, stride per row) of a tensor whose leading dims are rows ([T, ...]) or
    experts and rows ([E, C, ...]); contiguous-form rows are global, so no expert stride."""
    if t is None:
        return 0, 0
    if masked:
        return t.stride(0), t.stride(1)
    return 0, t.stride(0)


class GroupedLaunch:
    """One call signature's launch: ``launch(x, w, x_scale, w_scale, row_scale, index, out)``
    with fp32 scales (or None) and tensors of the validated shapes, strides and dtypes."""

    __slots__ = ("call", "device", "direct", "empty", "out_dtype", "out_shape")

    def __init__(self, spec: GroupedSpec, cfg: GroupedConfig, args, interpreted: bool):
        masked = spec.form == "masked"
        x, w, out = args.x, args.w, args.out
        lead = tuple(x.shape[:-1])
        self.out_shape, self.out_dtype, self.device = (*lead, spec.n), spec.out_dtype, x.device
        self.empty = spec.rows == 0 or spec.n == 0
        self.direct = x.device.type == "cuda" and not interpreted
        self.call = None
        if self.empty:
            return
        if out is not None:
            y_strides = _rows_strides(out, masked)
        else:  # a fresh contiguous output
            y_strides = (spec.rows * spec.n if masked else 0, spec.n)
        sx_e, sx_m = _rows_strides(args.x_scale, masked)
        sx_g = args.x_scale.stride(-1) if spec.x_scale is ScaleKind.GROUP else 0
        sw = args.w_scale
        sw_g = sw.stride(2) if spec.w_scale is ScaleKind.GROUP else 0
        ints = (
            spec.e, spec.rows, spec.n, spec.k,
            *_rows_strides(x, masked), w.stride(0), w.stride(1), *y_strides,
            sx_e, sx_m, sx_g, sw.stride(0), sw.stride(1), sw_g, *_rows_strides(args.row_scale, masked),
        )
        consts = constexprs(spec, cfg, interpreted)
        dtypes = (x.dtype, w.dtype, spec.out_dtype, _dtype(args.x_scale), torch.float32,
                  _dtype(args.row_scale), torch.int32)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        self.call = KernelCall(_THIS, "_grouped_kernel", launch_grid(spec, cfg), ints, dict(options, **consts),
                               dtypes)

    def __call__(self, x, w, x_scale, w_scale, row_scale, index, out) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        if self.call is not None:
            self.call((x, w, out, x_scale, w_scale, row_scale, index), self.direct and direct_launch_enabled())
        return out


def _dtype(t):
    return None if t is None else t.dtype


_PTR = {torch.int8: "*i8", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5", torch.uint8: "*u8",
        torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_sm90(spec: GroupedSpec, cfg: GroupedConfig):
    """``triton.compile`` of the kernel for sm_90 (no GPU needed): pointers, N, K and the
    operands' strides marked 16-divisible, as the JIT marks them for aligned tensors of such
    shapes (without it loads are not vectorized and the K loop is not pipelined)."""
    import triton
    from triton.backends.compiler import GPUTarget

    consts = constexprs(spec, cfg)
    x_dtype = spec.x_type.torch_dtype
    sig = {
        "x_ptr": _PTR[x_dtype], "w_ptr": _PTR[spec.w_type.torch_dtype], "y_ptr": _PTR[spec.out_dtype],
        "sx_ptr": "*fp32" if spec.x_scale is not ScaleKind.NONE else "constexpr",
        "sw_ptr": "*fp32", "rs_ptr": "*fp32" if spec.has_row_scale else "constexpr", "idx_ptr": "*i32",
    }
    ints = ("E", "ROWS", "N", "K", "stride_xe", "stride_xm", "stride_we", "stride_wn", "stride_ye",
            "stride_ym", "stride_sxe", "stride_sxm", "stride_sxg", "stride_swe", "stride_swn", "stride_swg",
            "stride_rse", "stride_rsm")
    sig.update((name, "i32") for name in ints)
    sig.update((name, "constexpr") for name in consts)
    for name in ("sx_ptr", "rs_ptr"):
        if sig[name] == "constexpr":
            consts[name] = None
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["N", "K", "stride_xe", "stride_xm", "stride_we", "stride_wn", "stride_ye", "stride_ym"]
    order = list(sig)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=_grouped_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
