"""Launching the prepacked-int4 decode kernel (``kernel.py``) for one call signature, and its
ahead-of-time compile source. The config comes from the plan (``tileq.dispatch.prepacked``).
"""

from __future__ import annotations

import torch

from ..._runtime import interpreter_active
from ...prepacked import BLOCK_K
from ..direct import KernelCall, direct_launch_enabled
from ..buffers import split_buffers
from ..split_k import flat_reduce_call
from . import kernel as _kernel_module
from .config import DTYPE_OF, Int4pConfig, kernel_ct, kernel_name

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp8": "*fp8e4nv", "bf8": "*fp8e5"}


def compile_source(x_type: str, w_scale: str, cfg: Int4pConfig, *, x_scale: str | None = None,
                   group_k: int = 128, has_bias: bool = False, even_k: bool = True, pdl: bool = False):
    """The kernel as ``triton.compile`` takes it for an ahead-of-time build (``tileq build``,
    ``tileq sass --prepacked``): bf16 output, the specialization a JIT launch makes for
    LLM shapes (16-byte aligned pointers, N, K and strides multiples of 16); ``pdl``: the
    programmatic-dependent-launch variant."""
    import triton

    sig = {"w_ptr": "*i32", "x_ptr": _PTR[x_type], "c_ptr": "*bf16",
           "sw_ptr": "*fp32", "sx_ptr": "*fp32", "bias_ptr": "*fp32", "ws_ptr": "*fp32", "sem_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32",
           "ldx": "i32", "ldc": "i32", "stride_sw_g": "i32", "stride_sw_n": "i32", "stride_sx": "i32"}
    div16 = ("N", "K", "ldx", "ldc", "stride_sw_g")
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(sig.items())
             if t.startswith("*") or name in div16}
    if x_scale is None:
        x_scale = "vector" if x_type in ("fp8", "bf8") else "none"
    consts = dict(CT=kernel_ct(x_type, cfg), W_SCALE=w_scale, X_SCALE=x_scale,
                  GROUP_K=group_k, HAS_BIAS=has_bias, BM=cfg.bm, SPLIT_K=cfg.split_k, EVEN_K=even_k,
                  INTERPRETED=False, BN=cfg.rows, SCALE_AHEAD=cfg.scale_ahead, FIXUP=cfg.in_kernel_sum,
                  STREAMK=cfg.streamk, PDL=pdl)
    return triton.compiler.ASTSource(fn=_kernel_module._i4p_kernel, signature=sig, constexprs=consts,
                                     attrs=attrs)


def compile_options(cfg: Int4pConfig) -> dict:
    opts = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return opts


class Int4pLaunch:
    """One call signature bound to its kernel launch (and split-K reduction) for the plan's config
    ``cfg``; ``num_sms``: the device's SMs (a stream-K config runs ``cfg.per_sm`` programs on each);
    ``pdl``: launched with programmatic dependent launch (the plan's ``pdl``)."""

    def __init__(self, m, n, k, x_type, out_dtype, w_scale_kind, sw_strides, x_scale_kind, sx_stride,
                 group_k, has_bias, device, cfg: Int4pConfig, cast_x: bool = False, *, num_sms: int, pdl: bool):
        # cast_x: the call's activations (fp8) are cast to x_type (bf16) before the kernel.
        self.m, self.n, self.out_dtype, self.device, self.cfg = m, n, out_dtype, device, cfg
        self.cast_to = DTYPE_OF[x_type] if cast_x else None
        self.interpreted = interpreter_active()
        self.direct = device.type == "cuda" and not self.interpreted
        ct = kernel_ct(x_type, cfg)
        tiles = -(-n // cfg.rows) * -(-m // cfg.bm)
        # stream-K: a program per slot the SMs hold, at most one per (tile, K block) unit
        programs = min(cfg.per_sm * num_sms, tiles * -(-k // BLOCK_K)) if cfg.streamk else 0
        grid = (programs, 1) if cfg.streamk else (tiles, cfg.split_k)
        ints = (m, n, k, k, n, sw_strides[0], sw_strides[1], sx_stride)
        consts = dict(CT=ct, W_SCALE=w_scale_kind, X_SCALE=x_scale_kind, GROUP_K=group_k,
                      HAS_BIAS=has_bias, BM=cfg.bm, SPLIT_K=cfg.split_k, EVEN_K=k % BLOCK_K == 0,
                      INTERPRETED=self.interpreted, BN=cfg.rows, SCALE_AHEAD=cfg.scale_ahead,
                      FIXUP=cfg.in_kernel_sum, STREAMK=cfg.streamk, num_warps=cfg.warps, num_stages=cfg.stages)
        if cfg.maxnreg and not self.interpreted:
            consts["maxnreg"] = cfg.maxnreg
        if pdl:
            consts.update(PDL=True, launch_pdl=True)
        self.name = kernel_name(x_type, w_scale_kind, cfg)
        # fp32 partials (values of the workspace) and tile counters of the kernel's own sum: stream-K
        # has two [rows, bm] slots per program and a counter per tile; a split [split_k, N, M]
        self.partials = self.counters = 0
        if cfg.streamk:
            self.partials, self.counters = 2 * programs * cfg.rows * cfg.bm, tiles
        elif cfg.split_k > 1:
            self.partials, self.counters = cfg.split_k * n * m, tiles if cfg.in_kernel_sum else 0
        # The activations' dtype is part of the launch's identity: e4m3, e5m2 and bf16 activations
        # share every constexpr (CT 'bf16') and would otherwise share one compiled kernel.
        self.main = KernelCall(_kernel_module, "_i4p_kernel", grid, ints, consts,
                               (torch.int32, DTYPE_OF[x_type], out_dtype, torch.float32, torch.float32, torch.float32,
                                torch.float32 if self.partials else None, torch.int32 if self.counters else None))
        self.reduce = None
        if cfg.split_k > 1 and not cfg.in_kernel_sum:
            self.reduce = flat_reduce_call(n, m, n, cfg.split_k, out_dtype, transposed=True, pdl=pdl)

    @property
    def untraced(self) -> str | None:
        """Why a traced launch cannot carry it, or None (``direct``'s statement): its kernels' own
        reasons (a given config's register cap: ``launch option maxnreg``)."""
        return self.main.untraced or (self.reduce.untraced if self.reduce is not None else None)

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        direct = self.direct and direct_launch_enabled()
        if self.cast_to is not None:
            x2 = x2.to(self.cast_to)
        ws = counters = None
        if self.partials:
            ws, counters = split_buffers(self.device, self.partials, direct, self.counters)
        self.main((wdata, x2, out, sw, sx, bias, ws, counters), direct)
        if self.reduce is not None:
            self.reduce((ws, out), direct)
        return out
