"""Launch the sm_90 Gluon prefill kernel (``ws_gemm.py``) for a plan; compile it ahead of time.

The plan chooses this family (``kernels/select.py``: sm_90, a tested Triton version, 8-bit rcr
prefill, the schemes it serves, switched on) and the config of each output path
(``GemmRoute.gluon_launch``); TMA adds conditions that only tensors can answer:
- A's and B's rows must be 16-byte aligned (``lda``, ``ldb`` multiples of 16 fp8 elements): a
  call signature without them gets the portable kernel's launch instead (``usable``);
- their base addresses must be 16-byte aligned: checked on every call; a call that fails runs
  the Triton kernel (``fallback``), which computes the same function;
- the output is written by TMA stores when its rows and base address are 16-byte aligned, by
  masked stores otherwise (e.g. N = 577 in bf16).
An acc_in is read with masked loads through its pointer and leading dimension (any alignment).
"""

from __future__ import annotations

import torch

from ...dtypes import OperandType
from ...problem import Problem, ScaleKind
from ..direct import KernelCall, TableKernel, direct_launch_enabled
from ..buffers import split_buffers
from ..split_k import tiles_reduce_call
from .config import GluonConfig, kernel_spec, mma_accumulates, split_schedule

_GL = {}
_KERNEL = TableKernel(_GL, "kernel", __name__)  # the kernel, once _gl() has imported it


def _gl():
    """Triton's Gluon pieces, imported on first use (not at tileq import)."""
    if not _GL:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from .ws_gemm import _ws_gemm_kernel

        _GL.update(gl=gl, TensorDescriptor=TensorDescriptor, kernel=_ws_gemm_kernel,
                   dtypes={torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                           torch.int8: gl.int8,
                           torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                           torch.float32: gl.float32})
    return _GL


def _gl_dtype(torch_dtype: torch.dtype):
    return _gl()["dtypes"][torch_dtype]


def c_box(cfg: GluonConfig) -> list[int]:
    """The TMA box of C one consumer stores per sub-tile: [64, sub_n], or its transpose when the
    kernel computes C^T (``swap_ab``)."""
    return [cfg.sub_n, cfg.block_m // 2] if cfg.swap_ab else [cfg.block_m // 2, cfg.sub_n]


def shared_layouts(spec, cfg: GluonConfig):
    """NVMMA (swizzled) shared layouts of the kernel's A, B and C tiles, as the descriptors carry
    them (A and B of the problem as the kernel sees it: ``kernel_spec``)."""
    gl = _gl()["gl"]
    spec = kernel_spec(spec, cfg)
    return (gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], _gl_dtype(spec.a_type.torch_dtype)),
            gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], _gl_dtype(spec.b_type.torch_dtype)),
            gl.NVMMASharedLayout.get_default_for(c_box(cfg), _gl_dtype(spec.out_dtype)))


def constexprs(spec, cfg: GluonConfig, tma_store: bool) -> dict:
    """The kernel's constexpr arguments for a problem (the launcher and the AOT build share it)."""
    spec = kernel_spec(spec, cfg)
    b_group = spec.b_scale_kind is ScaleKind.GROUP
    mma_acc = mma_accumulates(spec)
    return dict(
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SUB_N=cfg.sub_n, EPI_BUFS=cfg.epi_bufs,
        GROUP_M=cfg.group_m, STAGES=cfg.stages,
        A_SCALE=spec.a_scale_kind.value, B_SCALE=spec.b_scale_kind.value,
        GROUP_N=spec.group_n if b_group else 1,  # constant when unused: no needless recompiles
        HAS_BIAS=spec.has_bias, HAS_ACC=spec.has_acc, TMA_STORE=tma_store,
        INT_DOT=spec.integer_mainloop, MMA_ACC=mma_acc, OVERLAP=cfg.overlap and not mma_acc,
        SPLIT_K=cfg.split_k, SCALE_UNROLL=cfg.scale_unroll and spec.scheme.grouped,
        EPI_PRELOAD=cfg.epi_preload and cfg.sub_tiles == 1, TRANS_C=cfg.swap_ab,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
    )


def options(cfg: GluonConfig) -> dict:
    return dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)


_OUT_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
_2D = (ScaleKind.VECTOR, ScaleKind.GROUP)


def rows_aligned(leading_dim: int, elem_bytes: int) -> bool:
    """TMA's global strides are multiples of 16 bytes."""
    return (leading_dim * elem_bytes) % 16 == 0


def reads_with_tma(lda: int, ldb: int) -> bool:
    """Whether TMA can read 8-bit A and B of these leading dimensions (rows of 16-byte multiples)."""
    return rows_aligned(lda, 1) and rows_aligned(ldb, 1)


class GluonLaunch:
    """A plan's Gluon launch for tensors of fixed shapes, strides and dtypes (what ``GemmLaunch``
    is for the Triton kernel; ``tileq.gemm`` keeps one per call signature). Each call builds the
    three TMA descriptors (they hold data pointers) and launches through ``KernelCall``."""

    untraced = "_ws_gemm_kernel: TMA descriptors hold data pointers"  # (``direct``'s statements)
    counters = 0

    __slots__ = ("spec", "m", "n", "k", "lda", "ldb", "ldc", "out_dtype", "device", "cfg", "ints",
                 "c_rows_ok", "fallback", "direct", "_variants")

    def __init__(self, problem: Problem, plan, fallback):
        spec = problem.spec
        cfg = plan.route.gluon
        a, b = problem.a, problem.b
        self.spec, self.m, self.n, self.k = spec, spec.m, spec.n, spec.k
        self.lda = a.stride(0)  # A row-major [M, K]
        self.ldb = b.stride(1)  # B [K, N] K-contiguous: the rows of the [N, K] weight
        self.ldc = problem.out.stride(0) if problem.out is not None else spec.n
        self.out_dtype, self.device, self.cfg = spec.out_dtype, problem.device, cfg
        self.c_rows_ok = rows_aligned(self.ldc, _OUT_BYTES[spec.out_dtype])
        sa, sb = problem.a_scale, problem.b_scale
        # a_scale [M, 1] or [M, Gk] (either storage), b_scale [1, N] or [Gk, Gn]; 0 when unused.
        sa_m, sa_g = (sa.stride(0), sa.stride(1)) if spec.a_scale_kind in _2D else (0, 0)
        sb_g, sb_n = (sb.stride(0), sb.stride(1)) if spec.b_scale_kind in _2D else (0, 0)
        if spec.a_scale_kind is ScaleKind.VECTOR:
            sa_g = 0
        if spec.b_scale_kind is ScaleKind.VECTOR:
            sb_g = 0
        ld_acc = problem.acc.stride(0) if problem.acc is not None else 0  # acc_in [M, N], row-major
        km, kn = spec.m, spec.n  # the kernel's M and N
        if cfg.swap_ab:
            # The kernel's A scale is b_scale [Gk, N] read per row n and group g, its B scale
            # a_scale [M, 1] (or one value) read per column m.
            km, kn = spec.n, spec.m
            sa_m, sa_g, sb_g, sb_n = sb_n, sb_g, 0, sa_m
        self.ints = (km, kn, spec.k, self.ldc, ld_acc, sa_m, sa_g, sb_g, sb_n)
        self.fallback = fallback
        # Per output path (TMA store or masked stores): the plan's config and its KernelCall (grid,
        # integer arguments, constexprs); the shared layouts are made on first use (they need
        # Triton).
        sms = plan.facts.num_sms
        self.direct = problem.device.type == "cuda"
        # Everything a launch specializes on besides the constexprs: operand and output dtypes,
        # which optional pointers are present.
        ptr_types = (spec.a_type, spec.b_type, spec.out_dtype, problem.a_scale is not None,
                     problem.b_scale is not None, spec.has_bias, problem.acc is not None)
        self._variants = {}
        for tma_store in (True, False):
            vcfg = plan.route.gluon_launch(spec, sms, tma_store)
            programs, n_full, n_split = split_schedule(km, kn, vcfg, sms)
            consts = dict(constexprs(spec, vcfg, tma_store), **options(vcfg))
            call = KernelCall(_KERNEL, "_ws_gemm_kernel", (programs,), self.ints, consts,
                              ptr_types + (tma_store, vcfg.split_k))
            reduce, ws_numel = None, 0
            if vcfg.split_k > 1:
                # The split tiles' fp32 partials: [n_split * split_k, BM, BN] blocks, summed in order.
                ws_numel = n_split * vcfg.split_k * vcfg.block_m * vcfg.block_n
                reduce = tiles_reduce_call(n_split, km, kn, self.ldc, n_full, vcfg.split_k, vcfg.block_m,
                                           vcfg.block_n, vcfg.group_m, spec.out_dtype, vcfg.swap_ab)
            self._variants[tma_store] = [vcfg, call, None, reduce, ws_numel]

    def variant(self, tma_store: bool):
        """(config, KernelCall, shared layouts, the split tiles' reduction or None, its workspace's
        fp32 elements) of the TMA-store or masked-store launch."""
        v = self._variants[tma_store]
        if v[2] is None:
            v[2] = shared_layouts(self.spec, v[0])
        return v

    @property
    def usable(self) -> bool:
        """A's and B's rows are 16-byte aligned (8-bit: leading dimensions multiples of 16)."""
        return reads_with_tma(self.lda, self.ldb)

    def __call__(self, a, b, sa, sb, bias, acc, out) -> torch.Tensor:
        if (a.data_ptr() | b.data_ptr()) & 15:
            return self.fallback(a, b, sa, sb, bias, acc, out)
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        g = _gl()
        direct = self.direct and direct_launch_enabled()
        tma_store = self.c_rows_ok and out.data_ptr() % 16 == 0
        cfg, call, (a_l, b_l, c_l), reduce, ws_numel = self.variant(tma_store)
        td = g["TensorDescriptor"]
        # B's storage is the logical [K, N] view of an [N, K] weight: same pointer, its rows.
        a_op = (a, [self.m, self.k], [self.lda, 1])
        b_op = (b, [self.n, self.k], [self.ldb, 1])
        if cfg.swap_ab:  # the weight on the kernel's A side, the activations on its B side
            a_op, b_op, sa, sb = b_op, a_op, sb, sa
        a_desc = td(*a_op, [cfg.block_m, cfg.block_k], a_l)
        b_desc = td(*b_op, [cfg.block_n, cfg.block_k], b_l)
        c_desc = td(out, [self.m, self.n], [self.ldc, 1], c_box(cfg), c_l) if tma_store else None
        ws = None
        if reduce is not None:
            # (the whole stream buffer on the direct path: same pointer, no view made per call)
            ws = split_buffers(self.device, ws_numel, direct)[0]
        # The first launch of a signature goes through Triton's JIT launch, later ones straight to
        # the compiled kernel (whose launcher encodes the three TMA descriptors).
        call((a_desc, b_desc, c_desc, out, ws, sa, sb, bias, acc), direct)
        if reduce is not None:
            reduce((ws, out), direct)
        return out


# ---------------------------------------------------------------------------- AOT compile


def signature(spec, cfg: GluonConfig, tma_store: bool = True) -> tuple[dict, dict]:
    """(signature, constexprs) for ``triton.compile`` of this specialization on any machine."""
    _OUT_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    a_l, b_l, c_l = shared_layouts(spec, cfg)
    kspec = kernel_spec(spec, cfg)  # (the operand and scale order the kernel sees)
    out_ty = _OUT_TY[spec.out_dtype]
    op_ty = {OperandType.I8: "i8", OperandType.FP8: "fp8e4nv", OperandType.BF8: "fp8e5"}
    sig = {
        "a_desc": f"tensordesc<{op_ty[kspec.a_type]}[{cfg.block_m}, {cfg.block_k}],{a_l!r}>",
        "b_desc": f"tensordesc<{op_ty[kspec.b_type]}[{cfg.block_n}, {cfg.block_k}],{b_l!r}>",
        "c_desc": f"tensordesc<{out_ty}[{', '.join(map(str, c_box(cfg)))}],{c_l!r}>" if tma_store else "constexpr",
        "c_ptr": f"*{out_ty}",
        "ws_ptr": "*fp32" if cfg.split_k > 1 else "constexpr",
        "sa_ptr": "*fp32" if kspec.a_scale_kind is not ScaleKind.NONE else "constexpr",
        "sb_ptr": "*fp32" if kspec.b_scale_kind is not ScaleKind.NONE else "constexpr",
        "bias_ptr": "*fp32" if spec.has_bias else "constexpr",
        "acc_ptr": ("*i32" if spec.acc_dtype == torch.int32 else "*fp32") if spec.has_acc else "constexpr",
    }
    for name in ("M", "N", "K", "ldc", "ld_acc", "stride_sa_m", "stride_sa_g", "stride_sb_g", "stride_sb_n"):
        sig[name] = "i32"
    consts = constexprs(spec, cfg, tma_store)
    for name in consts:
        sig[name] = "constexpr"
    for name in ("c_desc", "ws_ptr", "sa_ptr", "sb_ptr", "bias_ptr", "acc_ptr"):
        if sig[name] == "constexpr":
            consts[name] = None
    return sig, consts


def compile_sm90(spec, cfg: GluonConfig, tma_store: bool = True):
    """Compile the kernel for sm_90 with Triton's own toolchain (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, consts = signature(spec, cfg, tma_store)
    src = GluonASTSource(fn=_gl()["kernel"], signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options(cfg))
