"""Launch the tile GEMM kernel for a Plan, and describe its specialization for AOT builds.

``specialization`` is the single mapping from (ProblemSpec, TileConfig) to the kernel's
constexprs: the launcher and ``tileq build`` both use it, so what is built is what runs.
"""

from __future__ import annotations

import torch
import triton

from ..catalog.config import TileConfig
from ..dtypes import OperandType, PackedInt4, mma_types
from ..problem import Problem, ProblemSpec, ScaleKind, ScaleLayout
from .gemm_kernel import _gemm_kernel, _splitk_reduce_kernel

REDUCE_BLOCK = 1024


_FLIP = {"r": "c", "c": "r"}


def specialization(spec: ProblemSpec, cfg: TileConfig, interpreted: bool = False,
                   b_scale_unit_n: bool = True) -> dict:
    """The constexpr arguments of ``_gemm_kernel`` for this problem and config.

    With ``cfg.swap_ab`` the kernel computes C^T = B^T A^T: B plays the kernel's A (so an int4
    weight packed along K is unpacked without a transpose and can feed the mma from registers,
    and a small M becomes the kernel's N), A plays its B, and the scales, bias and output follow.
    ``b_scale_unit_n``: whether a group b_scale has unit stride along N (it then becomes the
    kernel's K-group-major A scale); contiguous [Gk, Gn] scales do.
    """
    a_ct, b_ct = (t.value for t in mma_types(spec.a_type, spec.b_type))
    a_group = spec.a_scale_kind is ScaleKind.GROUP
    b_group = spec.b_scale_kind is ScaleKind.GROUP
    common = dict(
        # Constant when unused so unrelated values never cause a recompile.
        GROUP_K=spec.group_k if spec.scheme.grouped else 1,
        INT_DOT=spec.integer_mainloop, GROUPED=spec.scheme.grouped,
        HAS_BIAS=spec.has_bias, HAS_ACC=spec.has_acc,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k,
        INTERPRETED=interpreted, FAST_ACCUM=spec.fast_accum, SWAPPED=cfg.swap_ab,
    )
    if not cfg.swap_ab:
        return dict(
            A_TYPE=spec.a_type.value, B_TYPE=spec.b_type.value, A_CT=a_ct, B_CT=b_ct,
            A_LAYOUT=spec.layout[0], B_LAYOUT=spec.layout[1],
            A_SCALE=spec.a_scale_kind.value, B_SCALE=spec.b_scale_kind.value,
            SA_PRESHUFFLED=a_group and spec.a_scale_layout is ScaleLayout.PRESHUFFLED,
            GROUP_N=spec.group_n if b_group else 1, SA_ROW_GROUP=1, **common,
        )
    return dict(
        A_TYPE=spec.b_type.value, B_TYPE=spec.a_type.value, A_CT=b_ct, B_CT=a_ct,
        A_LAYOUT=_FLIP[spec.layout[1]], B_LAYOUT=_FLIP[spec.layout[0]],
        A_SCALE=spec.b_scale_kind.value, B_SCALE=spec.a_scale_kind.value,
        SA_PRESHUFFLED=b_group and b_scale_unit_n,
        GROUP_N=1, SA_ROW_GROUP=spec.group_n if b_group else 1, **common,
    )


_PTR = {
    OperandType.I8: "*i8", OperandType.FP8: "*fp8e4nv", OperandType.BF8: "*fp8e5",
    OperandType.I4: "*u8", OperandType.BF16: "*bf16", OperandType.FP16: "*fp16",
}
_OUT_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def signature(spec: ProblemSpec, cfg: TileConfig) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``triton.compile`` of this specialization (AOT).

    attrs mark pointers and N, K and the leading dimensions as multiples of 16, as the JIT does
    for aligned tensors: without them loads are not vectorized and the K loop is not pipelined.
    """
    consts = specialization(spec, cfg)
    a_t, b_t = (spec.b_type, spec.a_type) if cfg.swap_ab else (spec.a_type, spec.b_type)
    sa_k, sb_k = ((spec.b_scale_kind, spec.a_scale_kind) if cfg.swap_ab
                  else (spec.a_scale_kind, spec.b_scale_kind))
    sig = {
        "a_ptr": _PTR[a_t], "b_ptr": _PTR[b_t],
        "c_ptr": "*fp32" if cfg.split_k > 1 else _OUT_PTR[spec.out_dtype],
        "sa_ptr": "*fp32" if sa_k is not ScaleKind.NONE else "constexpr",
        "sb_ptr": "*fp32" if sb_k is not ScaleKind.NONE else "constexpr",
        "bias_ptr": "*fp32" if spec.has_bias else "constexpr",
        "acc_ptr": ("*i32" if spec.acc_dtype == torch.int32 else "*fp32") if spec.has_acc else "constexpr",
    }
    for name in ("M", "N", "K", "lda", "ldb", "ldc", "ld_acc",
                 "stride_sa_m", "stride_sa_g", "stride_sb_g", "stride_sb_n"):
        sig[name] = "i32"
    for name in consts:
        sig[name] = "constexpr"
    for name in ("sa_ptr", "sb_ptr", "bias_ptr", "acc_ptr"):
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


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A reusable fp32 split-K workspace per (device, stream): a call allocates nothing but its
    output, and a workspace used inside a CUDA graph capture stays alive for its replays."""
    if device.type != "cuda":
        return torch.empty(numel, dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws[:numel]


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
    spec, cfg = problem.spec, plan.config
    a, b = _storage(problem.a), _storage(problem.b)
    lda, ldb = _leading_dim(a, spec.layout[0]), _leading_dim(b, spec.layout[1])
    m, n, k = spec.m, spec.n, spec.k
    out = problem.out
    if out is None:
        out = torch.empty(m, n, dtype=spec.out_dtype, device=problem.device)
    sa, sb = problem.a_scale, problem.b_scale
    sa_rows, sa_g = _scale_strides(spec.a_scale_kind, sa, 0)
    sb_cols, sb_g = _scale_strides(spec.b_scale_kind, sb, 1)
    acc = problem.acc
    ld_acc = acc.stride(0) if acc is not None else 0
    unit_n = not (spec.b_scale_kind is ScaleKind.GROUP and sb.shape[1] > 1 and sb.stride(1) != 1)
    consts = specialization(spec, cfg, plan.interpreted, b_scale_unit_n=unit_n)
    if cfg.swap_ab:
        # The kernel's operands, sizes and scales are those of C^T = B^T A^T.
        ka, kb, km, kn, klda, kldb = b, a, n, m, ldb, lda
        ksa, ksb = sb, sa
        stride_sa_m, stride_sa_g, stride_sb_n, stride_sb_g = sb_cols, sb_g, sa_rows, sa_g
    else:
        ka, kb, km, kn, klda, kldb = a, b, m, n, lda, ldb
        ksa, ksb = sa, sb
        stride_sa_m, stride_sa_g, stride_sb_n, stride_sb_g = sa_rows, sa_g, sb_cols, sb_g

    target = out
    if cfg.split_k > 1:
        target = _workspace(problem.device, cfg.split_k * km * kn).view(cfg.split_k, km, kn)
    grid = (triton.cdiv(km, cfg.block_m) * triton.cdiv(kn, cfg.block_n), cfg.split_k)
    _gemm_kernel[grid](
        ka, kb, target, ksa, ksb, problem.bias, acc,
        km, kn, k,
        klda, kldb, out.stride(0), ld_acc,
        stride_sa_m, stride_sa_g, stride_sb_g, stride_sb_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **consts,
    )
    if cfg.split_k > 1:
        total = km * kn
        _splitk_reduce_kernel[(triton.cdiv(total, REDUCE_BLOCK),)](
            target, out, total, kn, out.stride(0), SPLIT_K=cfg.split_k, BLOCK=REDUCE_BLOCK,
            SWAPPED=cfg.swap_ab, num_warps=4,
        )
    return out
