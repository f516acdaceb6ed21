"""Launching the Gluon decode kernel (``decode_gluon_kernel.py``): GPU-tested and not routed (on
an H200 0.94 / 0.97x the Triton decode kernel's speed at M 1 / 16, the fastest of its stages and
splits per call: bench/results/h200/int4/gluon-decode/). ``GluonDecodeLaunch`` is called like
``launch.Int4pLaunch``; ``compile_sm90`` builds it for sm_90 without a GPU (the build checks).
16-bit activations only (W4A16); 16-token tiles (wgmma N = 16); 64 weight rows per program.
"""

from __future__ import annotations

import torch

from ..kernels.direct import KernelCall, TableKernel, direct_launch_enabled
from ..kernels.launch import split_buffers, splitk_reduce_call
from . import prefill
from .layout import BLOCK_K

ROWS = 64  # weight rows per program (one warpgroup, one wgmma height)
TOKENS = 16  # token tile (wgmma N)
STAGES = 2  # ring slots: 2 x 32 KB of shared memory (words 16 KB, activations 16 KB per 512 of K)
MAX_SPLIT = 8
_CT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_GL: dict = {}
_KERNEL = TableKernel(_GL, "kernel", __name__)


def _gl() -> dict:
    """The kernel, imported on first use (the TMA descriptor type is the prefill launcher's)."""
    if not _GL:
        from .decode_gluon_kernel import _i4p_decode_kernel

        _GL.update(kernel=_i4p_decode_kernel)
    return _GL


def constexprs(ct: str, w_kind: str, group_k: int, has_bias: bool, split: int = 1, stages: int = STAGES,
               fixup: bool = False) -> dict:
    from .prefill_kernel import asm_for

    if ct not in ("bf16", "fp16"):
        raise ValueError(f"the Gluon decode kernel takes 16-bit activations, not {ct}")
    if not 1 <= split <= MAX_SPLIT or stages < 2:
        raise ValueError(f"split {split} (1-{MAX_SPLIT}) / stages {stages} (at least 2)")
    if fixup and split == 1:
        raise ValueError("the in-kernel sum of partials (fixup) is for a split over K")
    return dict(CT=ct, W_SCALE=w_kind, X_SCALE="none", GROUP_K=group_k, HAS_BIAS=has_bias, BT=TOKENS, SPLIT=split,
                STAGES=stages, ASM0=asm_for(ct, 0, False), ASM1=asm_for(ct, 1, False), ASM2=asm_for(ct, 2, False),
                ASM3=asm_for(ct, 3, False), FIXUP=fixup)


def kernel_name(ct: str, w_kind: str, split: int = 1, stages: int = STAGES, fixup: bool = False) -> str:
    from .launch import _SCHEME_OF_W_SCALE

    sk = f"_sk{split}{'_fx' if fixup else ''}" if split > 1 else ""
    return (f"{_SCHEME_OF_W_SCALE[w_kind]}_{ct}xi4p_rcr_decode__gluon_m{ROWS}n{TOKENS}k{BLOCK_K}_s{stages}{sk}"
            f"_swap_sm90")


def _layouts(ct: str):
    """The words' and the activation tiles' shared layouts: the prefill kernel's (its words'
    layout does not depend on the box's rows)."""
    return prefill.layouts(ct, TOKENS)[:2]


class GluonDecodeLaunch:
    """One call signature of the Gluon decode kernel. ``fallback`` (a ``launch.Int4pLaunch``)
    takes operands TMA cannot read (base pointers or activation rows not 16-byte aligned)."""

    def __init__(self, m, n, k, x_dtype, out_dtype, w_kind, sw_strides, group_k, has_bias, device, fallback,
                 split: int = 1, stages: int = STAGES, fixup: bool = True):
        _gl()  # the kernel that self.call looks up at every launch
        self.fallback = fallback
        self.m, self.n, self.k, self.out_dtype, self.device = m, n, k, out_dtype, device
        self.ct = _CT[x_dtype]
        self.split = split
        self.fixup = fixup and split > 1
        self.name = kernel_name(self.ct, w_kind, split, stages, self.fixup)
        self.tiles = -(-n // ROWS) * -(-m // TOKENS)
        ints = (m, n, k, n, sw_strides[0], sw_strides[1], 0)
        self.call = KernelCall(_KERNEL, "_i4p_decode_kernel", (self.tiles, split), ints,
                               dict(constexprs(self.ct, w_kind, group_k, has_bias, split, stages, self.fixup),
                                    num_warps=4),
                               (x_dtype, out_dtype if split == 1 or self.fixup else torch.float32, has_bias))
        self.reduce = None
        if split > 1 and not self.fixup:
            self.reduce = splitk_reduce_call(m, n, n, split, out_dtype, swapped=False)
        self.layouts = None

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        if (x2.data_ptr() | wdata.data_ptr()) & 15 or (x2.stride(0) * x2.element_size()) % 16:
            return self.fallback(x2, wdata, sx, sw, bias, out)
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        if self.layouts is None:
            self.layouts = _layouts(self.ct)
        w_l, x_l = self.layouts
        td = prefill._gl()["TensorDescriptor"]
        kw = wdata.shape[1]
        w_desc = td(wdata, [self.n, kw], [kw, 1], [ROWS, 32], w_l)
        x_desc = td(x2, [self.m, self.k], [x2.stride(0), 1], [TOKENS, 64], x_l)
        direct = self.device.type == "cuda" and direct_launch_enabled()
        ws = counters = None
        target = out
        if self.split > 1:
            numel = self.split * self.m * self.n
            ws, counters = split_buffers(self.device, numel, direct, 2 * self.tiles if self.fixup else 0)
            if not self.fixup:
                target = ws
        self.call((w_desc, x_desc, target, sw, bias, None, ws, counters), direct)
        if self.reduce is not None:
            self.reduce((ws, out), direct)
        return out


def compile_sm90(ct: str = "bf16", w_kind: str = "group", group_k: int = 128, has_bias: bool = False,
                 split: int = 1, stages: int = STAGES, fixup: bool = False, out_ct: str | None = None,
                 one_token: bool = False):
    """The kernel for sm_90 with Triton's own toolchain (no GPU): for the build checks.
    ``one_token``: M a constant 1, as the JIT specializes a launch with one token."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out_ct = out_ct or ct
    w_l, x_l = _layouts(ct)
    sig = {"w_desc": f"tensordesc<i32[{ROWS}, 32],{w_l!r}>", "x_desc": f"tensordesc<{ct}[{TOKENS}, 64],{x_l!r}>",
           "c_ptr": f"*{out_ct}" if split == 1 or fixup else "*fp32", "sw_ptr": "*fp32",
           "bias_ptr": "*fp32" if has_bias else "constexpr", "sx_ptr": "constexpr",
           "ws_ptr": "*fp32" if split > 1 else "constexpr", "sem_ptr": "*i32" if fixup else "constexpr"}
    for name in ("M", "N", "K", "ldc", "stride_sw_g", "stride_sw_n", "stride_sx"):
        sig[name] = "i32"
    consts = constexprs(ct, w_kind, group_k, has_bias, split, stages, fixup)
    if one_token:
        consts["M"] = 1
    for name in consts:
        sig[name] = "constexpr"
    consts.update(sx_ptr=None)
    if not has_bias:
        consts["bias_ptr"] = None
    if split == 1:
        consts["ws_ptr"] = None
    if not fixup:
        consts["sem_ptr"] = None
    src = GluonASTSource(fn=_gl()["kernel"], signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
