"""Launching the sm_90 Gluon prefill kernel on prepacked int4 weights (``prefill_kernel.py``) for
one call signature, its constexprs and shared layouts, its instance names and its sm_90 build.

What it runs comes from the plan (``tileq.dispatch.prepacked``): the token tile, the split over K or
stream-K (``streamk.py``), the fp8 build (W4A8 fused) or the 16-bit build on activations cast to
bf16, the overlap of conversion and wgmma. TMA adds a condition only tensors can answer: an
activation or weight base pointer off 16 bytes runs the dequantize path instead (``fallback``).
"""

from __future__ import annotations

import torch

from ..direct import KernelCall, TableKernel, direct_launch_enabled
from ..buffers import split_buffers
from ..split_k import flat_reduce_call
from .config import SCHEME_OF_W_SCALE
from .streamk import schedule as streamk_schedule

TOKENS = 128  # BT: tokens per tile (wgmma N); a tile is 128 weight rows x BT tokens
TOKEN_TILES = (64, TOKENS, 256)  # the token tiles the kernel is built for
W_SLOTS = 2  # ring slots of 2 x [128, 32] words (one 512-wide K block each)
X_SLOTS = 8  # ring slots of [BT, 64] activations (two per 128-wide slice) ...
X_SLOTS_256 = 4  # ... and for 256-token tiles (32 KB each: 197 KB of shared memory in all)
TMA_STORE_MAX_TOKENS = 128  # 256-token tiles store with masked stores (the TMA staging needs 64 KB more)
GROUP_M = 8
# The 16-bit build's overlap of the next slice's conversion with this slice's wgmmas (the kernel's
# OVERLAP) builds for token tiles of at most OVERLAP_MAX_TOKENS (the 256-token build spilled 88 B).
OVERLAP_MAX_TOKENS = 128
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168

_CT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_GL = {}
_KERNEL = TableKernel(_GL, "kernel", __name__)  # the kernel, once _gl() has imported it


def tiles(m: int, n: int, tokens: int) -> int:
    """Tiles of ``tokens`` tokens x 128 weight rows in an M x N output."""
    return -(-m // tokens) * -(-n // 128)


def config_tag(tokens: int = TOKENS, split: int = 1, streamk: bool = False, x_scale: bool = False) -> str:
    """The kernel name's config part for a token tile (and a split over K, or stream-K;
    ``x_scale``: the 16-bit build with an activation scale in its epilogue, W4A8 on activations
    cast to bf16)."""
    sk = f"_sk{split}" if split > 1 else ""
    return f"gluon_w128t{tokens}k512{sk}{'_stk' if streamk else ''}_ws2x64{'_xs' if x_scale else ''}"


def overlap_builds(ct: str, tokens: int) -> bool:
    """Whether the build of compute type ``ct`` with ``tokens``-token tiles takes the overlap (the
    16-bit build up to OVERLAP_MAX_TOKENS; the fp8 build promotes per slice)."""
    return tokens <= OVERLAP_MAX_TOKENS and ct != "fp8"


def _gl():
    if not _GL:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from .prefill_kernel import _i4p_prefill_kernel

        _GL.update(gl=gl, TensorDescriptor=TensorDescriptor, kernel=_i4p_prefill_kernel)
    return _GL


def layouts(ct: str, tokens: int = TOKENS, out_ct: str | None = None):
    """Shared layouts of the words [128, 32] int32 (128-byte rows, 128-byte swizzle) and of the
    activation and output tiles [tokens, 64]: activations of ``ct`` (16-bit: 128-byte rows;
    'fp8': 64-byte rows), the output of ``out_ct`` (16-bit; default ``ct``)."""
    gl = _gl()["gl"]
    types = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp8": gl.float8e4nv}
    return (gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2),
            gl.NVMMASharedLayout.get_default_for([tokens, 64], types[ct]),
            gl.NVMMASharedLayout.get_default_for([tokens, 64], types[out_ct or ct]))


def constexprs(ct: str, w_kind: str, group_k: int, has_bias: bool, tma_store: bool, tokens: int = TOKENS,
               split: int = 1, x_scale: str = "none", streamk: bool = False, overlap: bool = False) -> dict:
    from .prefill_kernel import asm_for

    if tokens not in TOKEN_TILES:
        raise ValueError(f"token tile {tokens}: expected one of {TOKEN_TILES}")
    if split < 1 or (split > 1 and tma_store):
        raise ValueError(f"split {split}: expected 1 or more, with fp32 partials (no TMA store) above 1")
    if streamk and split > 1:
        raise ValueError("stream-K and a split over K exclude each other")
    if tma_store and tokens > TMA_STORE_MAX_TOKENS:
        raise ValueError(f"token tile {tokens}: no TMA store above {TMA_STORE_MAX_TOKENS} tokens")
    if x_scale != "none" and tokens > TMA_STORE_MAX_TOKENS:
        # (the sm_90 build of a 256-token tile with token scales spilled 200 B)
        raise ValueError(f"token tile {tokens}: no activation scale above {TMA_STORE_MAX_TOKENS} tokens")
    if ct == "fp8" and (tokens > TMA_STORE_MAX_TOKENS or x_scale == "none" or w_kind != "group"):
        # (per-channel and per-tensor weight scales spilled 16-32 B on the sm_90 build)
        raise ValueError(f"fp8 activations (W4A8 fused): group scales, token tiles of at most "
                         f"{TMA_STORE_MAX_TOKENS} and an activation scale, not {w_kind} / {tokens} tokens / "
                         f"x_scale {x_scale!r}")
    if overlap and not overlap_builds(ct, tokens):
        # (the 256-token build spilled 88 B; the fp8 build promotes per slice, not changed)
        raise ValueError(f"overlap: the 16-bit build's token tiles of at most {OVERLAP_MAX_TOKENS}, not "
                         f"{ct} / {tokens} tokens")
    grouped = w_kind == "group"
    return dict(CT=ct, W_SCALE=w_kind, X_SCALE=x_scale, GROUP_K=group_k, HAS_BIAS=has_bias, TMA_STORE=tma_store,
                SPLIT=split, STREAM_K=streamk, OVERLAP=overlap,
                BT=tokens, GROUP_M=GROUP_M, WS=W_SLOTS, XS=X_SLOTS if tokens <= 128 else X_SLOTS_256,
                ASM0=asm_for(ct, 0, grouped), ASM1=asm_for(ct, 1, grouped), ASM2=asm_for(ct, 2, grouped),
                ASM3=asm_for(ct, 3, grouped), CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)


class GluonPrefillLaunch:
    """The Gluon prefill kernel for one call signature, called like ``launch.Int4pLaunch``: the
    plan's token tile ``tokens``, split over K (``split``) or stream-K (``streamk``) on
    ``num_sms`` SMs, the fp8 build (``fused``) or the 16-bit one, the overlap (``overlap``)."""

    untraced = "_i4p_prefill_kernel: TMA descriptors hold data pointers"  # (``direct``'s statements)
    counters = 0

    def __init__(self, m, n, k, x_dtype, out_dtype, w_kind, sw_strides, group_k, has_bias, device, fallback, *,
                 tokens: int, num_sms: int, overlap: bool, split: int = 1, x_kind: str = "none",
                 sx_stride: int = 0, fused: bool = False, streamk: bool = False):
        self.fallback = fallback  # for operands TMA cannot read (base pointers not 16-byte aligned)
        self.m, self.n, self.k, self.out_dtype, self.device = m, n, k, out_dtype, device
        # fp8 activations (W4A8) are cast to bf16 (exact) before the kernel, their scale in its
        # epilogue; ``fused``: the kernel's fp8 build reads them as they are
        self.cast_to = torch.bfloat16 if x_dtype in _FP8 and not fused else None
        self.ct = "fp8" if x_dtype in _FP8 and fused else _CT[self.cast_to or x_dtype]
        sms = num_sms
        self.tokens = tokens
        self.split = split
        self.overlap = overlap
        self.name = kernel_name(self.ct, w_kind, self.tokens, split, streamk, self.ct != "fp8" and x_kind != "none")
        self.direct = device.type == "cuda"
        count = tiles(m, n, self.tokens)
        # Stream-K (streamk.py): one program per SM (the kernel derives its data-parallel tiles
        # from the grid), ``per`` (tile, K block) units of the rest per program.
        self.streamk = streamk_schedule(count, k, sms) if streamk else None
        per = self.streamk.per if streamk else 0
        ints = (m, n, k, n, sw_strides[0], sw_strides[1], sx_stride, per)
        options = dict(num_warps=4, maxnreg=MAXNREG)
        grid = (self.streamk.programs if streamk else max(1, min(sms, count * split)),)
        # The first launch of each output path goes through Triton's JIT launch, later ones
        # straight to the compiled kernel (whose launcher encodes the TMA descriptors). Split
        # over K, every item writes an fp32 partial into a [split, M, N] workspace, summed in
        # order by the split-K reduction of the portable kernels.
        self.calls = {tma: KernelCall(_KERNEL, "_i4p_prefill_kernel", grid, ints,
                                      dict(constexprs(self.ct, w_kind, group_k, has_bias, tma, self.tokens, split,
                                                      x_kind, streamk, self.overlap), **options),
                                      (self.cast_to or x_dtype, out_dtype if split == 1 else torch.float32, has_bias,
                                       tma, x_kind, streamk, self.overlap))
                      for tma in ((True, False) if split == 1 and self.tokens <= TMA_STORE_MAX_TOKENS else (False,))}
        self.reduce = None
        if split > 1:
            self.reduce = flat_reduce_call(m, n, n, split, out_dtype, transposed=False)
        self.shared_sum = None  # stream-K: the sum of the tiles several programs share
        if streamk and self.streamk.shared:
            from . import streamk as sk

            sch = self.streamk
            self.shared_sum = KernelCall(sk, "_sum_shared_tiles_kernel",
                                         (sch.programs - 1, -(-self.tokens // sk.SUM_TOKENS)),
                                         (m, n, n, sch.per, sch.k_blocks, sch.dp, sch.units, -(-m // self.tokens),
                                          -(-n // 128)),
                                         dict(BT=self.tokens, GROUP_M=GROUP_M, BLOCK_T=sk.SUM_TOKENS,
                                              SLABS=sch.slabs, num_warps=4), (torch.float32, out_dtype))
        self.layouts = None

    def __call__(self, x2, wdata, sx, sw, bias, out=None) -> torch.Tensor:
        if self.cast_to is not None:
            x2 = x2.to(self.cast_to)  # (a new tensor: 16-byte aligned, rows of stride K)
        if (x2.data_ptr() | wdata.data_ptr()) & 15:
            return self.fallback(x2, wdata, sx, sw, bias, out)
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.out_dtype, device=self.device)
        g = _gl()
        if self.layouts is None:
            self.layouts = layouts(self.ct, self.tokens, _CT[self.out_dtype])
        w_l, x_l, c_l = self.layouts
        td = g["TensorDescriptor"]
        kw = wdata.shape[1]
        w_desc = td(wdata, [self.n, kw], [kw, 1], [128, 32], w_l)
        x_desc = td(x2, [self.m, self.k], [x2.stride(0), 1], [self.tokens, 64], x_l)
        direct = self.direct and direct_launch_enabled()
        if self.split > 1:
            numel = self.split * self.m * self.n
            ws = split_buffers(self.device, numel, direct)[0]
            self.calls[False]((w_desc, x_desc, None, ws, sw, bias, sx, None), direct)
            self.reduce((ws, out), direct)
            return out
        tma_store = (True in self.calls and (self.n * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
                     and out.is_contiguous())
        c_desc = td(out, [self.m, self.n], [self.n, 1], [self.tokens, 64], c_l) if tma_store else None
        ws = None
        if self.streamk is not None:
            numel = self.streamk.slabs * self.m * self.n  # (slabs written only where tiles are shared)
            ws = split_buffers(self.device, numel, direct)[0]
        self.calls[tma_store]((w_desc, x_desc, c_desc, out, sw, bias, sx, ws), direct)
        if self.shared_sum is not None:
            self.shared_sum((ws, out), direct)
        return out


def kernel_name(x_type: str, w_kind: str, tokens: int = TOKENS, split: int = 1, streamk: bool = False,
                x_scale: bool = False) -> str:
    """The kernel's catalog-style name: scheme, the kernel's activation type x prepacked int4, rcr,
    the prefill pipeline, the Gluon tile (128 weight rows x ``tokens`` tokens x 512 of K, two
    consumers; a split over K, or stream-K; ``x_scale``: a 16-bit build with the activations'
    scale in its epilogue, '_xs', for W4A8 cast to bf16: another binary than W4A16's)."""
    tag = config_tag(tokens, split, streamk, x_scale)
    return f"{SCHEME_OF_W_SCALE[w_kind]}_{x_type}xi4p_rcr_prefill__{tag}_sm90"


def compile_sm90(ct: str, w_kind: str, group_k: int = 128, has_bias: bool = False, tma_store: bool = True,
                 tokens: int = TOKENS, split: int = 1, x_scale: str = "none", out_ct: str | None = None,
                 streamk: bool = False, *, overlap: bool):
    """The kernel for sm_90 with Triton's own toolchain (no GPU): for the build checks. ``ct``
    'fp8': e4m3 activations (W4A8 fused), the output ``out_ct`` (default bf16); ``overlap``: as the
    plan's (``dispatch.int4.overlap_for``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out_ct = out_ct or ("bf16" if ct == "fp8" else ct)
    w_l, x_l, c_l = layouts(ct, tokens, out_ct)
    x_ty = "fp8e4nv" if ct == "fp8" else ct
    sig = {"w_desc": f"tensordesc<i32[128, 32],{w_l!r}>", "x_desc": f"tensordesc<{x_ty}[{tokens}, 64],{x_l!r}>",
           "c_desc": f"tensordesc<{out_ct}[{tokens}, 64],{c_l!r}>" if tma_store else "constexpr",
           "c_ptr": f"*{out_ct}" if split == 1 else "*fp32", "sw_ptr": "*fp32",
           "bias_ptr": "*fp32" if has_bias else "constexpr", "sx_ptr": "*fp32" if x_scale != "none" else "constexpr",
           "ws_ptr": "*fp32" if streamk else "constexpr"}
    for name in ("M", "N", "K", "ldc", "stride_sw_g", "stride_sw_n", "stride_sx", "per"):
        sig[name] = "i32"
    consts = constexprs(ct, w_kind, group_k, has_bias, tma_store, tokens, split, x_scale, streamk, overlap)
    for name in consts:
        sig[name] = "constexpr"
    if not tma_store:
        consts["c_desc"] = None
    if not has_bias:
        consts["bias_ptr"] = None
    if x_scale == "none":
        consts["sx_ptr"] = None
    if not streamk:
        consts["ws_ptr"] = None
    src = GluonASTSource(fn=_gl()["kernel"], signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))
