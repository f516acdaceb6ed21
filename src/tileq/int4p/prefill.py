"""Prefill on prepacked int4 weights with the sm_90 Gluon kernel (``prefill_kernel.py``).

``linear_prepacked`` takes this path from ``DEQUANT_MIN_M`` tokens on where the kernel serves the
call (``unserved`` says why not), and the dequantize + cuBLAS path (``dequant.py``) otherwise:
W4A16 (bf16 or fp16 activations without an activation scale), a 16-bit output, sm_90 compiled
(not interpreted) with a Triton version the Gluon kernels were tested with, activations whose
rows are 16-byte aligned, ``TILEQ_GLUON`` not 0. fp8 activations (W4A8) with a per-token or
per-tensor scale run it below ``W4A8_MAX_M`` tokens (its fp8 build with group scales and e4m3,
else cast to bf16) and the fp8 GEMM on the values from there (``fp8_prefill.py``, or
``dequant.py`` with ``TILEQ_W4A8_PREFILL=bf16``).
From ``MIN_M`` tokens below ``DEQUANT_MIN_M`` it takes the calls ``plan`` gives it (split over K
on narrow weights, unsplit where the tiles fill the SMs); the decode kernel takes the others.
W4A16 from TOKENS to STREAMK_MAX_M - 1 tokens runs stream-K (``streamk.py``) instead of the
plan's tiling where ``streamk_for`` finds its waves clearly cheaper.
"""

from __future__ import annotations

import os

import torch

from ..kernels import select
from ..kernels.direct import KernelCall, TableKernel, direct_launch_enabled
from ..kernels.launch import split_buffers, splitk_reduce_call
from .dequant import DEQUANT_MIN_M
from .streamk import k_blocks
from .streamk import schedule as streamk_schedule

TOKENS = 128  # BT: tokens per tile (wgmma N); a tile is 128 weight rows x BT tokens
# 64 tokens for calls of up to 64 (``tokens_for``); 16: decode, not routed (slower); 256: from
# T256_MIN_M tokens where its waves cost less (each weight converted once per 256 tokens)
TOKEN_TILES = (16, 64, 128, 256)
W_SLOTS = 2  # ring slots of 2 x [128, 32] words (one 512-wide K block each)
X_SLOTS = 8  # ring slots of [BT, 64] activations (two per 128-wide slice) ...
X_SLOTS_256 = 4  # ... and for 256-token tiles (32 KB each: 197 KB of shared memory in all)
TMA_STORE_MAX_TOKENS = 128  # 256-token tiles store with masked stores (the TMA staging needs 64 KB more)
GROUP_M = 8


def tiles(m: int, n: int, tokens: int) -> int:
    """Tiles of ``tokens`` tokens x 128 weight rows in an M x N output."""
    return -(-m // tokens) * -(-n // 128)


def config_tag(tokens: int = TOKENS, split: int = 1, streamk: bool = False, x_scale: bool = False,
               fixup: bool = False) -> str:
    """The kernel name's config part for a token tile (and a split over K, '_fx' where the kernel
    sums the split's partials itself, or stream-K; ``x_scale``: the 16-bit build with an
    activation scale in its epilogue, W4A8 on activations cast to bf16)."""
    sk = f"_sk{split}{'_fx' if fixup else ''}" if split > 1 else ""
    return f"gluon_w128t{tokens}k512{sk}{'_stk' if streamk else ''}_ws2x64{'_xs' if x_scale else ''}"


MAX_SPLIT = 8
FIXUP_MAX_TOKENS = 64  # the token tiles whose split partials the kernel can sum itself (constexprs)
# The 16-bit consumers' next slice converted while this slice's wgmmas run (the kernel's OVERLAP),
# for token tiles of at most OVERLAP_MAX_TOKENS unless OVERLAP is cleared. On an H200
# (bench/results/h200/int4/overlap/, the routed calls with and without it in one run, 18 weights):
# 1.034x / 1.034x / 1.043x / 1.044x / 1.040x faster at 40 / 64 / 128 / 200 / 256 tokens (medians,
# 0.999-1.064x over 80 calls); the result is bit for bit the same (the same wgmma chain).
OVERLAP = True
OVERLAP_MAX_TOKENS = 128


def overlap_for(ct: str, tokens: int) -> bool:
    """Whether a build of compute type ``ct`` with ``tokens``-token tiles overlaps its conversion
    with the wgmmas by default (the 16-bit build up to OVERLAP_MAX_TOKENS, while OVERLAP is set)."""
    return OVERLAP and tokens <= OVERLAP_MAX_TOKENS and ct != "fp8"


def split_for(m: int, n: int, k: int, tokens: int, num_sms: int) -> int:
    """K ranges per tile for a grid of fewer tiles than SMs (1 otherwise): the split whose items
    take the fewest K blocks one after another, waves x the blocks of one range (ties: the
    smaller split, whose partials cost less to write and sum), each range at least
    ``min_split_blocks(m)`` 512-wide K blocks.

    A range holds ceil(blocks / split) blocks (the last range can be short or empty), so a
    split that does not divide the blocks saves less than 1 / split. Costed as 1 / split, 7 ways
    for DeepSeek-V3 down (36 blocks) at 48-128 tokens ran 1.06-1.13x slower than 2 ways, and 8
    ways for Qwen3-14B down (34 blocks) at 160-256 tokens 1.08-1.16x slower than 3 ways (H200,
    bench/results/h200/int4/split-cost/, every split timed in one run); this cost picks 2 and 3."""
    if tiles(m, n, tokens) >= num_sms:
        return 1
    cands = [s for s in range(1, MAX_SPLIT + 1) if k_blocks(k) >= min_split_blocks(m) * s]
    return min(cands, key=lambda s: (plan_cost(m, n, k, tokens, s, num_sms), s)) if cands else 1


def min_split_blocks(m: int) -> int:
    """512-wide K blocks per K range: 2 up to one 128-token tile, 4 beyond. Above 128 tokens a
    tile's K loop is long enough that the unsplit kernel beat splits of 2-3 blocks per range
    (H200, bench/results/h200/int4/split-k/, M = 256: K of 3584-5120 in 3-4 ranges ran 0.87-0.97x);
    at 48-128 tokens such splits still beat every other path (up to 1.45x)."""
    return 2 if m <= TOKENS else 4


# The split over K takes a call whose tiling leaves at least a third of the SMs without a tile
# (at most SPLIT_FILL x SMs tiles) where split_for finds a split. Measured on an H200
# (bench/results/h200/int4/split-k/, 18 weights at M 48, 64, 128 and 256, every path timed in one
# run): against the path without it, 1.02-1.92x at M 48-64 (median 1.38x), at M = 128 1.13-1.56x
# on all but one weight with 86 tiles (0.94x; hence 0.65), at M = 256 1.05-1.68x where the ranges
# keep four K blocks. Token tile: 64 up to 64 tokens, else 128 (at M = 128 the 128-token split
# beat the 64-token one on 14 of 15 weights: each weight converted once).
SPLIT_FILL = 0.65


def plan(m: int, n: int, k: int, num_sms: int, x_scale: bool = False) -> tuple[int, int] | None:
    """(token tile, split over K) of this kernel for a call of ``m`` tokens, or None where the
    decode kernel takes it (below MIN_M tokens; below DEQUANT_MIN_M without a split and without
    the tiles ``prefers`` asks for). ``x_scale``: the call brings an activation scale (W4A8),
    which 256-token tiles do not take. Whether the kernel serves the call is ``unserved``'s answer."""
    if m < MIN_M:
        return None
    tokens = 64 if m <= 64 else TOKENS
    if tiles(m, n, tokens) <= SPLIT_FILL * num_sms:
        split = split_for(m, n, k, tokens, num_sms)
        if split > 1:
            return tokens, split
    if m >= DEQUANT_MIN_M or prefers(m, n, num_sms):
        return tokens_for(m, n, num_sms, x_scale), 1
    return None


# Below DEQUANT_MIN_M tokens (where the decode kernel's 32-token tiles convert each weight once per
# 32 tokens) a call takes this kernel unsplit from MIN_M tokens when it has enough tiles to fill
# the SMs (``prefers``); with fewer weight rows, split over K (``plan``).
# Measured on an H200 (bench/results/h200/int4/small-m/, 18 weights x M in {32, 48, 64, 96, 128,
# 192}, the decode kernel and both token tiles timed in one run): against the decode kernel
# alone, median 1.00x / 1.00x / 1.27x / 1.48x / 1.51x at M 48 / 64 / 96 / 128 / 192 (up to 1.45x
# at 48-64 on the widest weights), never slower, within 10% of the faster of the two kernels
# everywhere; at M = 32 the 64-token tile lost everywhere (0.31-1.10x: half of it padding).
MIN_M = 33
SMALL_M_FILL = 0.65  # tiles per SM (of the 64-token tiling) needed below M = 128 ...
SMALL_M_FILL_128 = 0.5  # ... and from 128 tokens on (the decode kernel's cost grows with M)
TILE64_COST = 0.8  # a 64-token tile's time over a 128-token tile's (same weights, half the wgmma)


def prefers(m: int, n: int, num_sms: int) -> bool:
    """Whether a call of M < DEQUANT_MIN_M tokens takes this kernel (where it serves) rather than
    the decode kernel: from MIN_M tokens, with at least SMALL_M_FILL(_128) x SMs tiles of 128
    weight rows x 64 tokens."""
    return m >= MIN_M and tiles(m, n, 64) >= (SMALL_M_FILL_128 if m >= 128 else SMALL_M_FILL) * num_sms


def tokens_for(m: int, n: int | None = None, num_sms: int = 132, x_scale: bool = False) -> int:
    """The token tile of a call: 64 tokens up to M = 64 (a 128-token tile would be half padding;
    each weight is converted once per token tile); below DEQUANT_MIN_M the one of 64 and 128
    with the cheaper waves of the persistent grid, a 64-token tile costing TILE64_COST of a
    128-token one; from T256_MIN_M 256 where its waves cost less (a 256-token tile at
    TILE256_COST), the call has no activation scale (``x_scale``) and, below T256_THIN_MAX_M, the
    last 256-token tile holds at least 128 tokens; else 128; 128 without ``n``."""
    if m <= 64:
        return 64
    if n is None:
        return TOKENS
    if m >= T256_MIN_M:
        cheaper = TILE256_COST * waves(m, n, 256, num_sms) < waves(m, n, TOKENS, num_sms)
        thin = m < T256_THIN_MAX_M and 0 < m % 256 < TOKENS
        return 256 if cheaper and not x_scale and not thin else TOKENS
    if m >= DEQUANT_MIN_M:
        return TOKENS
    return 64 if TILE64_COST * waves(m, n, 64, num_sms) < waves(m, n, TOKENS, num_sms) else TOKENS


def waves(m: int, n: int, tokens: int, num_sms: int) -> int:
    """Waves of the persistent grid for tiles of ``tokens`` tokens x 128 weight rows."""
    return -(-tiles(m, n, tokens) // num_sms)


# 256-token tiles (masked stores, four activation slots). Measured on an H200 (11 weights at M 1024
# and 4096, bench/results/h200/int4/t256/): per-channel scales, against 128-token tiles, 0.85-1.00x
# the time where this wave cost picks them and 1.14-1.26x where it does not (M = 1024 on N of
# 5120-6144: 2 waves against 3); a 256-token tile ran at 1.7x a 128-token one's time. From 256
# tokens since the run of bench/results/h200/int4/round6/ (18 weights, 256-token tiles forced at
# M 256-4096 beside the default path): at M = 512 the rule picks them for 14 of 18 weights, 1.12x
# faster than 128-token tiles with group scales (median of 18, up to 1.31x, none slower) and
# 1.02x per-channel (0.94-1.18x: three wide weights lose 3-7%); at M = 256 for 4 of 18, up to
# 1.22x, none slower by more than 3%.
T256_MIN_M = DEQUANT_MIN_M
TILE256_COST = 1.7
# ... but not where the last 256-token tile would hold fewer than 128 tokens, below 512 tokens:
# such a tile ran slower than a full one (DeepSeek-V3 down, 112 tiles in one wave: 282 / 265 / 234
# us at 288 / 320 / 352 tokens against 206 at 512). H200, 18 weights at 288 / 320 / 352 tokens,
# both tilings and stream-K timed in one run (bench/results/h200/int4/thin-t256/): the wave cost
# picks 256 for four weights; stream-K already replaced it on three, and on Qwen3-14B qkv the
# 128-token tiling (with stream-K) runs 1.29 / 1.23 / 1.11x faster (1.28x at 288 in int4/fp16-checks/).
T256_THIN_MAX_M = 512


# Stream-K (streamk.py) where its waves cost clearly less than the plan's tiling: W4A16 from
# TOKENS to STREAMK_MAX_M - 1 tokens. A stream-K program costs its K blocks (whole data-parallel
# tiles, then ``per`` units) plus STREAMK_OVERHEAD blocks (its partial tiles' epilogues and the
# fix-up), against the plan's waves x K blocks per item (256-token tiles at TILE256_COST either
# way), and must win by STREAMK_MARGIN. Fitted on an H200 (bench/results/h200/int4/streamk-hybrid/,
# 18 weights at M 128 / 200 / 256 / 512 / 1024, 128- and 256-token stream-K forced beside the
# default path): the measured overhead was 1.5-4.1 blocks (median 2.7); at 1024 tokens stream-K
# won on 1 of 18 weights with group scales (0.73-1.04x), so it stops below.
STREAMK_OVERHEAD = 3
STREAMK_MARGIN = 1.1
STREAMK_MAX_M = 1024
# 256-token stream-K from 129 tokens (the cost model as it stands; the plain 256-token tiling
# keeps T256_MIN_M): at 129-255 tokens 128-token tiles convert each weight twice, a 256-token
# tile once. H200, 18 weights, every stream-K tiling timed beside the default path in one run per
# line (bench/results/h200/int4/): fitted at 160 and 200 tokens (fp16-decode/), checked at 144 /
# 224 (fp16-routed/) and 176 / 240 (fp16-checks/). Against the rule before, 6 calls change per
# M, 1.09-1.16x faster (medians per M; 0.98-1.27x); geometric means over all 18 weights
# 1.031-1.049x per M. Left alone: 128-token stream-K on Llama-2-7B up (8 K blocks) at 144 and
# 160 tokens ran 0.70x and 0.73x the plan's time (0.91x in streamk-routed/) and 1.13-1.14x at
# 200 and 224; a guard on the last token tile's fill cost 0.61-0.90x on six weights at 288.
STREAMK_T256_MIN_M = TOKENS + 1


def _block_cost(tokens: int) -> float:
    """A K block of one tile, in 128-token tiles' blocks."""
    return TILE256_COST if tokens == 256 else 1.0


def plan_cost(m: int, n: int, k: int, tokens: int, split: int, num_sms: int) -> float:
    """A tiling's K blocks per SM one after another: waves of the grid's items x the blocks of
    the longest K range (a 256-token tile's at TILE256_COST)."""
    return -(-tiles(m, n, tokens) * split // num_sms) * -(-k_blocks(k) // split) * _block_cost(tokens)


def streamk_cost(m: int, n: int, k: int, tokens: int, num_sms: int) -> float:
    """Stream-K's in the same units: a program's data-parallel tiles' K blocks, its ``per``
    units and STREAMK_OVERHEAD."""
    s = streamk_schedule(tiles(m, n, tokens), k, num_sms)
    return (s.dp // num_sms * s.k_blocks + s.per + STREAMK_OVERHEAD) * _block_cost(tokens)


def streamk_for(m: int, n: int, k: int, tokens: int, split: int, num_sms: int, x_scale: bool = False
                ) -> tuple[int, bool]:
    """(token tile, stream-K) for a call the plan gave (``tokens``, ``split``): stream-K with 128-
    or (from STREAMK_T256_MIN_M) 256-token tiles where its cost beats the plan's by STREAMK_MARGIN,
    else the plan's tiles. W4A16 only (``x_scale``: W4A8 keeps its tiling; its fp8 build with stream-K
    ran 0.89x at 128 tokens, median of 18 weights)."""
    if x_scale or not TOKENS <= m < STREAMK_MAX_M:
        return tokens, False
    best = (plan_cost(m, n, k, tokens, split, num_sms), tokens, False)
    for t in (TOKENS, 256) if m >= STREAMK_T256_MIN_M else (TOKENS,):
        cost = streamk_cost(m, n, k, t, num_sms) * STREAMK_MARGIN
        if cost < best[0]:
            best = (cost, t, True)
    return best[1], best[2]


CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168

# With group scales the kernel multiplies every converted value by its scale (a packed multiply
# per two weights); from 1024 tokens dequantize + cuBLAS is faster. H200, 18 weights, both paths
# in one run (bench/results/h200/int4/fp8-prefill/, the dequantization at 3.4 TB/s): at M = 1024
# this kernel took 1.074x dequantize + cuBLAS's time (median; 0.93-1.39x: faster only on the three
# weights of 34816 rows and more, by 1-7%), at 256 0.70x (0.62-1.08x). (With the earlier dequantization at
# about half that rate the crossing was at 2048.) Per-channel and per-tensor scales (applied in
# the epilogue) match it at 4096 and beat it below.
GROUP_SCALE_MAX_M = 1024
# ... except 256-token tiles (where ``tokens_for`` picks them) below GROUP_T256_MAX_M: at M = 1024 they
# took 0.84-1.00x dequantize + cuBLAS's time on the 8 of 11 weights where the wave cost picks them
# (median 0.89; the three it passes over ran 1.19-1.39x); at 4096 1.05x (median)
# (bench/results/h200/int4/t256/).
GROUP_T256_MAX_M = 2048

_CT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_GL = {}
_KERNEL = TableKernel(_GL, "kernel", __name__)  # the kernel, once _gl() has imported it


# W4A8 (fp8 activations with a per-token or per-tensor scale) runs this kernel below W4A8_MAX_M
# tokens, where the plan gives it the call: with group scales and e4m3 activations its fp8 build
# (``fp8_prefill.fused_for``), else on the activations cast to bf16; from there the fp8 GEMM on
# the int4 values (``fp8_prefill.py``). H200, 18 weights, every path in one run
# (bench/results/h200/int4/w4a8-gluon/): the cast path took 0.75x the decode kernel's time at
# M = 48 and 0.60x at 128 (medians). Since the fp8 GEMM runs bquant with one-column groups
# swapped (bench/results/h200/int4/w4a8-swapped/), it took 0.92x this kernel's time at M = 256
# with group scales (0.71-1.00x), 0.64x at 512; per-channel 0.95x at 256 (0.75-1.11x): from 256
# tokens for every weight scale kind (was 512 with group scales). The fp8 build against the fp8
# GEMM at 256: 1.07x, slower on 4 of 18 weights (bench/results/h200/int4/w4a8-fused/).
W4A8_MAX_M = 256


def _problem_reason(x_type: str, x_kind: str, out_dtype: torch.dtype, k: int, m: int, w_kind: str,
                    tokens: int | None = None, fused: bool = False) -> str | None:
    w4a8 = x_type in ("fp8", "bf8") and x_kind in ("vector", "scalar")
    if fused and w4a8:  # (TILEQ_W4A8_PREFILL=fused: the fp8 kernel at every M it is given)
        if x_type != "fp8":
            return "the fused fp8 kernel takes e4m3 activations only (e5m2 not built yet)"
        if w_kind != "group":
            return "the fused fp8 kernel takes group scales only (per-channel builds spilled)"
        if out_dtype not in _CT:
            return "bf16/fp16 outputs only"
        return "K a multiple of 16 (16-byte fp8 activation rows for TMA)" if k % 16 else None
    if w_kind == "group" and m >= GROUP_SCALE_MAX_M and not (tokens == 256 and m < GROUP_T256_MAX_M):
        return (f"with group scales, dequantize + cuBLAS from {GROUP_SCALE_MAX_M} tokens (measured faster; "
                f"256-token tiles below {GROUP_T256_MAX_M} where their waves cost less)")
    if not w4a8 and (x_type not in ("bf16", "fp16") or x_kind != "none"):
        return ("bf16/fp16 activations without an activation scale (W4A16) or fp8 ones with a per-token "
                "or per-tensor scale (W4A8) only")
    if w4a8 and m >= W4A8_MAX_M:
        from .fp8_prefill import fused_wide_rule

        return (f"W4A8 from {W4A8_MAX_M} tokens: the fp8 GEMM on the int4 values (measured faster; with group "
                f"scales and e4m3 the fp8 build {fused_wide_rule()})")
    if out_dtype not in _CT:
        return "bf16/fp16 outputs only"
    if k % 8:
        return "K a multiple of 8 (16-byte activation rows for TMA)"
    return None


def _version_reason() -> str | None:
    version = select._triton_version()
    if version not in select.GLUON_TRITON_VERSIONS:
        return f"Gluon kernels are tested with Triton {', '.join(select.GLUON_TRITON_VERSIONS)} only, this is {version}"
    return None


def unserved(m: int, k: int, x_type: str, x_kind: str, w_kind: str, out_dtype: torch.dtype,
             device: torch.device, tokens: int | None = None, fused: bool = False) -> str | None:
    """Why the Gluon prefill kernel does not serve (or is not chosen for) a call with the plan's
    token tile ``tokens``, or None (``fused``: W4A8 on the fused fp8 kernel)."""
    from .._runtime import interpreter_active

    why = _problem_reason(x_type, x_kind, out_dtype, k, m, w_kind, tokens, fused)
    if why is not None:
        return why
    if device.type != "cuda" or interpreter_active():
        return "a compiled kernel on a GPU"
    from ..plan import _device_arch

    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _device_arch(index)[0].name
    if arch != select.GLUON_ARCH:
        return f"Gluon kernels are {select.GLUON_ARCH} only, this is {arch}"
    why = _version_reason()
    if why is None and select.gluon_switch(os.environ.get(select.GLUON_ENV)) is False:
        why = f"{select.GLUON_ENV}=0 switches the Gluon kernels off"
    return why


def unserved_on_sm90(m: int, k: int, x_type: str, w_kind: str, tokens: int | None = None,
                     fused: bool = False) -> str | None:
    """``unserved`` for a described call (no tensors) on an sm_90 GPU with the default switch:
    activations of ``x_type`` without a scale, the output in their type."""
    out = torch.bfloat16 if x_type == "bf16" else torch.float16
    x_kind = "none" if x_type in ("bf16", "fp16") else "vector"
    return _problem_reason(x_type, x_kind, out, k, m, w_kind, tokens, fused) or _version_reason()


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
               split: int = 1, x_scale: str = "none", streamk: bool = False, fixup: bool = False,
               overlap: bool = False) -> dict:
    from .prefill_kernel import asm_for

    if tokens not in TOKEN_TILES:
        raise ValueError(f"token tile {tokens}: expected one of {TOKEN_TILES}")
    if not 1 <= split <= MAX_SPLIT or (split > 1 and tma_store):
        raise ValueError(f"split {split}: expected 1-{MAX_SPLIT}, with fp32 partials (no TMA store) above 1")
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
    if overlap and (tokens > OVERLAP_MAX_TOKENS or ct == "fp8"):
        # (the 256-token build spilled 88 B; the fp8 build promotes per slice, not changed)
        raise ValueError(f"overlap: the 16-bit build's token tiles of at most {OVERLAP_MAX_TOKENS}, not "
                         f"{ct} / {tokens} tokens")
    if fixup and (split == 1 or tokens > FIXUP_MAX_TOKENS):
        # (a 128-token build spilled 160 B: the sum's 64 pointers per thread beside its values)
        raise ValueError(f"the in-kernel sum of partials (fixup) is for a split over K of token tiles of at most "
                         f"{FIXUP_MAX_TOKENS}, not split {split} / {tokens} tokens")
    grouped = w_kind == "group"
    return dict(CT=ct, W_SCALE=w_kind, X_SCALE=x_scale, GROUP_K=group_k, HAS_BIAS=has_bias, TMA_STORE=tma_store,
                SPLIT=split, STREAM_K=streamk, FIXUP=fixup, OVERLAP=overlap,
                BT=tokens, GROUP_M=GROUP_M, WS=W_SLOTS, XS=X_SLOTS if tokens <= 128 else X_SLOTS_256,
                ASM0=asm_for(ct, 0, grouped), ASM1=asm_for(ct, 1, grouped), ASM2=asm_for(ct, 2, grouped),
                ASM3=asm_for(ct, 3, grouped), CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)


class GluonPrefillLaunch:
    """The prefill path for one call signature, called like ``launch.Int4pLaunch``."""

    def __init__(self, m, n, k, x_dtype, out_dtype, w_kind, sw_strides, group_k, has_bias, device, fallback,
                 tokens: int | None = None, split: int = 1, x_kind: str = "none", sx_stride: int = 0,
                 fused: bool = False, streamk: bool = False, fixup: bool = False, overlap: bool | None = None):
        from ..kernels.gluon.launch import _num_sms

        self.fallback = fallback  # for operands TMA cannot read (base pointers not 16-byte aligned)
        self.m, self.n, self.k, self.out_dtype, self.device = m, n, k, out_dtype, device
        # fp8 activations (W4A8) are cast to bf16 (exact) before the kernel, their scale in its
        # epilogue; ``fused``: the kernel's fp8 build reads them as they are
        self.cast_to = torch.bfloat16 if x_dtype in _FP8 and not fused else None
        self.ct = "fp8" if x_dtype in _FP8 and fused else _CT[self.cast_to or x_dtype]
        sms = _num_sms(device)
        self.tokens = tokens or tokens_for(m, n, sms)
        self.split = split
        # fixup: a split's partials summed by the kernel (the last warpgroup of each half tile)
        self.fixup_split = fixup and split > 1 and self.tokens <= FIXUP_MAX_TOKENS
        self.overlap = overlap_for(self.ct, self.tokens) if overlap is None else overlap
        self.name = kernel_name(self.ct, w_kind, self.tokens, split, streamk, self.ct != "fp8" and x_kind != "none",
                                self.fixup_split)
        self.direct = device.type == "cuda"
        count = tiles(m, n, self.tokens)
        self.counters = 2 * count if self.fixup_split else 0  # (one per half tile)
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
        # order by the split-K reduction of the portable kernels, or with fixup by the kernel.
        self.calls = {tma: KernelCall(_KERNEL, "_i4p_prefill_kernel", grid, ints,
                                      dict(constexprs(self.ct, w_kind, group_k, has_bias, tma, self.tokens, split,
                                                      x_kind, streamk, self.fixup_split, self.overlap), **options),
                                      (self.cast_to or x_dtype,
                                       out_dtype if split == 1 or self.fixup_split else torch.float32, has_bias,
                                       tma, x_kind, streamk, self.fixup_split, self.overlap))
                      for tma in ((True, False) if split == 1 and self.tokens <= TMA_STORE_MAX_TOKENS else (False,))}
        self.reduce = None
        if split > 1 and not self.fixup_split:
            self.reduce = splitk_reduce_call(m, n, n, split, out_dtype, swapped=False)
        self.fixup = None
        if streamk and self.streamk.shared:
            from . import streamk as sk

            sch = self.streamk
            self.fixup = KernelCall(sk, "_fixup_kernel", (sch.programs - 1, -(-self.tokens // sk.FIXUP_TOKENS)),
                                    (m, n, n, sch.per, sch.k_blocks, sch.dp, sch.units, -(-m // self.tokens),
                                     -(-n // 128)),
                                    dict(BT=self.tokens, GROUP_M=GROUP_M, BLOCK_T=sk.FIXUP_TOKENS, SLABS=sch.slabs,
                                         num_warps=4), (torch.float32, out_dtype))
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
            ws, counters = split_buffers(self.device, numel, direct, self.counters)
            if self.fixup_split:
                self.calls[False]((w_desc, x_desc, None, out, sw, bias, sx, ws, counters), direct)
            else:
                self.calls[False]((w_desc, x_desc, None, ws, sw, bias, sx, None, None), direct)
                self.reduce((ws, out), direct)
            return out
        tma_store = (True in self.calls and (self.n * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
                     and out.is_contiguous())
        c_desc = td(out, [self.m, self.n], [self.n, 1], [self.tokens, 64], c_l) if tma_store else None
        ws = None
        if self.streamk is not None:
            numel = self.streamk.slabs * self.m * self.n  # (slabs written only where tiles are shared)
            ws = split_buffers(self.device, numel, direct)[0]
        self.calls[tma_store]((w_desc, x_desc, c_desc, out, sw, bias, sx, ws, None), direct)
        if self.fixup is not None:
            self.fixup((ws, out), direct)
        return out


def kernel_name(x_type: str, w_kind: str, tokens: int = TOKENS, split: int = 1, streamk: bool = False,
                x_scale: bool = False, fixup: bool = False) -> str:
    """The kernel's catalog-style name: scheme, the kernel's activation type x prepacked int4, rcr,
    the prefill pipeline, the Gluon tile (128 weight rows x ``tokens`` tokens x 512 of K, two
    consumers; a split over K, or stream-K; ``x_scale``: a 16-bit build with the activations'
    scale in its epilogue, '_xs', for W4A8 cast to bf16: another binary than W4A16's)."""
    from .launch import _SCHEME_OF_W_SCALE

    tag = config_tag(tokens, split, streamk, x_scale, fixup)
    return f"{_SCHEME_OF_W_SCALE[w_kind]}_{x_type}xi4p_rcr_prefill__{tag}_sm90"


def compile_sm90(ct: str, w_kind: str, group_k: int = 128, has_bias: bool = False, tma_store: bool = True,
                 tokens: int = TOKENS, split: int = 1, x_scale: str = "none", out_ct: str | None = None,
                 streamk: bool = False, fixup: bool = False, overlap: bool | None = None):
    """The kernel for sm_90 with Triton's own toolchain (no GPU): for the build checks. ``ct``
    'fp8': e4m3 activations (W4A8 fused), the output ``out_ct`` (default bf16); ``overlap`` None:
    as a launch decides (``overlap_for``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out_ct = out_ct or ("bf16" if ct == "fp8" else ct)
    if overlap is None:
        overlap = overlap_for(ct, tokens)
    w_l, x_l, c_l = layouts(ct, tokens, out_ct)
    x_ty = "fp8e4nv" if ct == "fp8" else ct
    sig = {"w_desc": f"tensordesc<i32[128, 32],{w_l!r}>", "x_desc": f"tensordesc<{x_ty}[{tokens}, 64],{x_l!r}>",
           "c_desc": f"tensordesc<{out_ct}[{tokens}, 64],{c_l!r}>" if tma_store else "constexpr",
           "c_ptr": f"*{out_ct}" if split == 1 or fixup else "*fp32", "sw_ptr": "*fp32",
           "bias_ptr": "*fp32" if has_bias else "constexpr", "sx_ptr": "*fp32" if x_scale != "none" else "constexpr",
           "ws_ptr": "*fp32" if streamk or fixup else "constexpr", "sem_ptr": "*i32" if fixup else "constexpr"}
    for name in ("M", "N", "K", "ldc", "stride_sw_g", "stride_sw_n", "stride_sx", "per"):
        sig[name] = "i32"
    consts = constexprs(ct, w_kind, group_k, has_bias, tma_store, tokens, split, x_scale, streamk, fixup, overlap)
    for name in consts:
        sig[name] = "constexpr"
    if not tma_store:
        consts["c_desc"] = None
    if not has_bias:
        consts["bias_ptr"] = None
    if x_scale == "none":
        consts["sx_ptr"] = None
    if not streamk and not fixup:
        consts["ws_ptr"] = None
    if not fixup:
        consts["sem_ptr"] = None
    src = GluonASTSource(fn=_gl()["kernel"], signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))
