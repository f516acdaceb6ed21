"""Launch the tile GEMM kernel for a Plan, and describe its specialization for AOT builds.

``specialization`` is the single mapping from (ProblemSpec, TileConfig) to the kernel's
constexprs: the launcher and ``tileq build`` both use it, so what is built is what runs.
"""

from __future__ import annotations

import sys

import torch

from ..dtypes import OperandType, PackedInt4
from ..problem import Problem, ProblemSpec, ScaleKind, ScaleLayout
from . import buffers
from .config import TileConfig
from .direct import KernelCall, direct_launch_enabled, tracing
from .gluon.launch import GluonLaunch, reads_with_tma
from .gemm_kernel import _gemm_kernel  # noqa: F401 (on _THIS)
from .select import i4_words_path, triton_kernel  # noqa: F401 (i4_words_path re-exported)
from .split_k import flat_reduce_call

_THIS = sys.modules[__name__]  # KernelCall looks the kernels up here at call time (tests stub them)


def i4_storage_word_aligned(storage: torch.Tensor, leading_dim: int) -> bool:
    """16-bit word loads need an even base address and an even row pitch (in bytes)."""
    return storage.data_ptr() % 2 == 0 and leading_dim % 2 == 0


def specialization(spec: ProblemSpec, cfg: TileConfig, interpreted: bool = False,
                   b_scale_unit_n: bool = True, i4_word_aligned: bool = True, *, pdl: bool = False,
                   fixup: bool = False) -> dict:
    """The constexpr arguments of ``_gemm_kernel`` for this problem and config.

    With ``cfg.swap_ab`` the kernel computes C^T = B^T A^T: B plays the kernel's A (so an int4
    weight packed along K is unpacked without a transpose and can feed the mma from registers,
    and a small M becomes the kernel's N), A plays its B, and the scales, bias and output follow.
    ``b_scale_unit_n``: whether a group b_scale has unit stride along N (it then becomes the
    kernel's K-group-major A scale); contiguous [Gk, Gn] scales do. ``i4_word_aligned``: whether
    an int4 operand's storage allows the 16-bit word path (``i4_storage_word_aligned``).
    ``pdl``: the kernel prefetches and waits for the previous kernel (``kernels/pdl.py``).
    ``fixup``: a split over K summed by the kernel itself (the plan's ``in_kernel_sum``).
    """
    tk = triton_kernel(spec, cfg)
    o = tk.orientation
    common = dict(
        # Constant when unused so unrelated values never cause a recompile.
        GROUP_K=spec.group_k if spec.scheme.grouped else 1,
        INT_DOT=spec.integer_mainloop, GROUPED=spec.scheme.grouped,
        HAS_BIAS=spec.has_bias, HAS_ACC=spec.has_acc,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k,
        INTERPRETED=interpreted, FAST_ACCUM=spec.fast_accum, SWAPPED=o.swapped,
        # Every K tile full: no K masks (the loads become plain async copies).
        EVEN_K=tk.even_k,
        I4_WORDS=tk.i4_words and i4_word_aligned,
        A_TYPE=o.a_type.value, B_TYPE=o.b_type.value, A_CT=o.a_ct.value, B_CT=o.b_ct.value,
        A_LAYOUT=o.a_layout, B_LAYOUT=o.b_layout, A_SCALE=o.a_scale.value, B_SCALE=o.b_scale.value,
        PDL=pdl, FIXUP=fixup and cfg.split_k > 1,
    )
    a_group = spec.a_scale_kind is ScaleKind.GROUP
    b_group = spec.b_scale_kind is ScaleKind.GROUP
    if not o.swapped:
        return dict(
            SA_PRESHUFFLED=a_group and spec.a_scale_layout is ScaleLayout.PRESHUFFLED,
            GROUP_N=spec.group_n if b_group else 1, SA_ROW_GROUP=1, **common,
        )
    return dict(
        SA_PRESHUFFLED=b_group and b_scale_unit_n,
        GROUP_N=1, SA_ROW_GROUP=spec.group_n if b_group else 1, **common,
    )


_PTR = {
    OperandType.I8: "*i8", OperandType.FP8: "*fp8e4nv", OperandType.BF8: "*fp8e5",
    OperandType.I4: "*u8", OperandType.BF16: "*bf16", OperandType.FP16: "*fp16",
}
_OUT_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def signature(spec: ProblemSpec, cfg: TileConfig, *, pdl: bool = False, fixup: bool = False
              ) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``triton.compile`` of this specialization (AOT).

    attrs mark pointers and N, K and the leading dimensions as multiples of 16, as the JIT does
    for aligned tensors: without them loads are not vectorized and the K loop is not pipelined.
    ``pdl`` and ``fixup`` as in ``specialization``.
    """
    consts = specialization(spec, cfg, pdl=pdl, fixup=fixup)
    o = triton_kernel(spec, cfg).orientation
    a_t, b_t, sa_k, sb_k = o.a_type, o.b_type, o.a_scale, o.b_scale
    sig = {
        "a_ptr": _PTR[a_t], "b_ptr": _PTR[b_t],
        "c_ptr": "*fp32" if cfg.split_k > 1 else _OUT_PTR[spec.out_dtype],
        "sa_ptr": "*fp32" if sa_k is not ScaleKind.NONE else "constexpr",
        "sb_ptr": "*fp32" if sb_k is not ScaleKind.NONE else "constexpr",
        "bias_ptr": "*fp32" if spec.has_bias else "constexpr",
        "acc_ptr": ("*i32" if spec.acc_dtype == torch.int32 else "*fp32") if spec.has_acc else "constexpr",
        "out_ptr": _OUT_PTR[spec.out_dtype] if consts["FIXUP"] else "constexpr",
        "sem_ptr": "*i32" if consts["FIXUP"] else "constexpr",
    }
    for name in ("M", "N", "K", "lda", "ldb", "ldc", "ld_acc",
                 "stride_sa_m", "stride_sa_g", "stride_sb_g", "stride_sb_n"):
        sig[name] = "i32"
    for name in consts:
        sig[name] = "constexpr"
    for name in ("sa_ptr", "sb_ptr", "bias_ptr", "acc_ptr", "out_ptr", "sem_ptr"):
        if sig[name] == "constexpr":
            consts[name] = None
    aligned = [name for name, ty in sig.items() if ty.startswith("*")]
    aligned += ["N", "K", "lda", "ldb", "ldc"] + (["ld_acc"] if spec.has_acc else [])
    order = list(sig)
    attrs = {(order.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return sig, consts, attrs


def _storage(x) -> torch.Tensor:
    return x.data if isinstance(x, PackedInt4) else x


def _leading_dim(t: torch.Tensor, layout_char: str) -> int:
    """The non-unit stride: dim 0's for 'r' storage, dim 1's for 'c'."""
    return t.stride(0) if layout_char == "r" else t.stride(1)


def _scale_strides(kind: ScaleKind, t, rows_dim: int) -> tuple[int, int]:
    """(stride along the scaled rows/columns, stride along K groups) of a normalized scale.

    ``rows_dim`` is the dimension of ``t`` that runs along the kernel's scaled axis: 0 for an
    a_scale ([M, 1] / [M, Gk]), 1 for a b_scale ([1, N] / [Gk, Gn]).
    """
    if kind is ScaleKind.VECTOR:
        return t.stride(rows_dim), 0
    if kind is ScaleKind.GROUP:
        return t.stride(rows_dim), t.stride(1 - rows_dim)
    return 0, 0


def launch_gemm(problem: Problem, plan) -> torch.Tensor:
    """Run ``plan`` on ``problem``'s tensors; returns the output."""
    return make_launch(problem, plan)(
        _storage(problem.a), _storage(problem.b), problem.a_scale, problem.b_scale, problem.bias,
        problem.acc, problem.out,
    )


def output_tiles(spec: ProblemSpec, cfg: TileConfig) -> int:
    """The portable kernel's output tiles (its grid's first axis): a split it sums itself counts
    on one tile counter each."""
    km, kn = (spec.n, spec.m) if triton_kernel(spec, cfg).swapped else (spec.m, spec.n)
    return _cdiv(km, cfg.block_m) * _cdiv(kn, cfg.block_n)


def launch_statement(plan, lda: int, ldb: int) -> tuple[str | None, int]:
    """(``untraced``, ``counters``) of the launch ``make_launch`` makes for ``plan`` on operands
    of leading dimensions ``lda`` and ``ldb``, without making it (``direct``'s statements)."""
    if plan.route.impl == "gluon" and reads_with_tma(lda, ldb):
        return GluonLaunch.untraced, GluonLaunch.counters
    return None, output_tiles(plan.spec, plan.config) if plan.route.in_kernel_sum else 0


def make_launch(problem: Problem, plan):
    """The launch of a plan for tensors of these shapes, strides and dtypes: the Gluon kernel's
    when the plan chose it and TMA can read A and B (16-byte aligned rows), else the Triton
    kernel's (``GemmLaunch``, also the Gluon launch's per-call fallback)."""
    triton_launch = GemmLaunch(problem, plan)
    if plan.route.impl == "gluon":
        gluon_launch = GluonLaunch(problem, plan, triton_launch)
        if gluon_launch.usable:
            return gluon_launch
    return triton_launch


class GemmLaunch:
    """Everything about running a plan on tensors of given shapes, strides and dtypes that does
    not depend on where their data lives: the kernel's integer arguments and constexprs, the grid,
    the split-K reduction. ``tileq.gemm`` keeps one per call signature (api.py), so a repeated
    call only gathers its tensors and launches.

    Calling it takes the storage tensors (a PackedInt4's ``.data``) and normalized scales, or any
    tensors with the same dtypes and data pointers (the kernel reads through pointers and the
    strides fixed here): ``linear`` passes the weight itself for its transposed view.
    """

    __slots__ = ("m", "n", "out_dtype", "device", "swapped", "split_k", "ws_shape", "direct",
                 "main", "main_bytes", "i4_arg", "i4_ld", "reduce", "counters")

    def __init__(self, problem: Problem, plan):
        spec, cfg = problem.spec, plan.config
        a, b = _storage(problem.a), _storage(problem.b)
        lda, ldb = _leading_dim(a, spec.layout[0]), _leading_dim(b, spec.layout[1])
        m, n, k = spec.m, spec.n, spec.k
        # A fresh output is a contiguous [M, N]: its row stride is N.
        ldc = problem.out.stride(0) if problem.out is not None else n
        sa, sb = problem.a_scale, problem.b_scale
        sa_rows, sa_g = _scale_strides(spec.a_scale_kind, sa, 0)
        sb_cols, sb_g = _scale_strides(spec.b_scale_kind, sb, 1)
        ld_acc = problem.acc.stride(0) if problem.acc is not None else 0
        unit_n = not (spec.b_scale_kind is ScaleKind.GROUP and sb.shape[1] > 1 and sb.stride(1) != 1)
        pdl = plan.pdl
        fixup = plan.route.in_kernel_sum
        consts = specialization(spec, cfg, plan.interpreted, b_scale_unit_n=unit_n, pdl=pdl, fixup=fixup)
        # The int4 word path also needs an even storage address: a pointer property, so it is
        # decided on every call (__call__), between these constexprs and the byte-path ones.
        self.i4_arg, self.i4_ld, bytes_consts = None, 0, None
        if OperandType.I4 in (spec.a_type, spec.b_type):
            bytes_consts = specialization(spec, cfg, plan.interpreted, b_scale_unit_n=unit_n,
                                          i4_word_aligned=False, pdl=pdl, fixup=fixup)
            if bytes_consts != consts:
                self.i4_arg = 0 if spec.a_type is OperandType.I4 else 1
                self.i4_ld = lda if self.i4_arg == 0 else ldb
        swapped = triton_kernel(spec, cfg).swapped
        if swapped:
            # The kernel's operands, sizes and scales are those of C^T = B^T A^T.
            km, kn, klda, kldb = n, m, ldb, lda
            strides = (sb_cols, sb_g, sa_g, sa_rows)  # stride_sa_m, _sa_g, _sb_g, _sb_n
        else:
            km, kn, klda, kldb = m, n, lda, ldb
            strides = (sa_rows, sa_g, sb_g, sb_cols)
        self.m, self.n, self.out_dtype, self.device = m, n, spec.out_dtype, problem.device
        self.swapped, self.split_k = swapped, cfg.split_k
        self.ws_shape = (cfg.split_k, km, kn)
        # Straight through the compiled kernel's launcher only on a GPU: the interpreter has no
        # compiled kernels and keeps the ordinary JIT launch.
        self.direct = problem.device.type == "cuda" and not plan.interpreted
        grid = (output_tiles(spec, cfg), cfg.split_k)
        ints = (km, kn, k, klda, kldb, ldc, ld_acc) + strides
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if pdl:
            options["launch_pdl"] = True
        # The pointer arguments' dtypes, as the kernel sees them (a call passes the same ones).
        target_dtype = torch.float32 if cfg.split_k > 1 else spec.out_dtype
        ka, kb, ksa, ksb = (b, a, sb, sa) if swapped else (a, b, sa, sb)
        fixed = consts["FIXUP"]
        dtypes = (ka.dtype, kb.dtype, target_dtype, _dtype(ksa), _dtype(ksb), _dtype(problem.bias),
                  _dtype(problem.acc), spec.out_dtype if fixed else None, torch.int32 if fixed else None)
        # The kernel's own sum counts on one counter per output tile (the grid's first axis).
        self.counters = grid[0] if fixed else 0
        self.main = KernelCall(_THIS, "_gemm_kernel", grid, ints, dict(options, **consts), dtypes)
        self.main_bytes = None
        if self.i4_arg is not None:
            self.main_bytes = KernelCall(_THIS, "_gemm_kernel", grid, ints, dict(options, **bytes_consts),
                                          dtypes)
        self.reduce = None
        if cfg.split_k > 1 and not fixed:
            self.reduce = flat_reduce_call(km, kn, ldc, cfg.split_k, spec.out_dtype, swapped, pdl=pdl)

    @property
    def untraced(self) -> str | None:
        """Why a traced launch cannot carry it, or None (``direct``'s statement): its kernels' own
        reasons (traced, an int4 operand takes the byte path: its address is unknown)."""
        main = self.main_bytes or self.main
        return main.untraced or (self.reduce.untraced if self.reduce is not None else None)

    def __call__(self, a, b, sa, sb, bias, acc, out) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        direct = self.direct and direct_launch_enabled()
        target = out
        if self.split_k > 1:
            if direct:
                # The whole buffer: same pointer and dtype as the view, without making the view.
                target = buffers._stream_workspace(self.device, self.split_k * self.ws_shape[1] * self.ws_shape[2])
            else:
                target = buffers._workspace(self.device, self.split_k * self.ws_shape[1] * self.ws_shape[2])
                target = target.view(self.ws_shape)
        main = self.main
        # Traced into a graph, the storage's address is unknown: the byte path serves any.
        if self.i4_arg is not None and (tracing() or not i4_storage_word_aligned(b if self.i4_arg else a,
                                                                                 self.i4_ld)):
            main = self.main_bytes
        fix_out = sem = None
        if self.counters:
            fix_out, sem = out, buffers.tile_counters(self.device, self.counters)
        if self.swapped:
            main((b, a, target, sb, sa, bias, acc, fix_out, sem), direct)
        else:
            main((a, b, target, sa, sb, bias, acc, fix_out, sem), direct)
        if self.reduce is not None:
            self.reduce((target, out), direct)
        return out


def _dtype(t):
    return None if t is None else t.dtype


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a constexpr_function in Triton 3.6: 2-3 us a call from host code.
    return -(-a // b)

