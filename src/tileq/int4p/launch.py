"""Launching the prepacked-int4 kernel: validation, config choice, cached direct launches.

``linear_prepacked(x, w, x_scale, w_scale)`` is what ``tileq.linear`` runs for a
``PrepackedInt4`` weight: y = x @ W^T with W's group (bquant) or per-channel scales, x 16-bit
(W4A16) or fp8 with per-token or per-tensor scales (W4A8; converted exactly to bf16 in the
kernel, so the products run on bf16 wgmma).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, replace

import torch

from .._runtime import bounded_put, interpreter_active
from ..errors import DTypeError, ShapeError, expect
from ..kernels.direct import KernelCall, direct_launch_enabled
from ..kernels.gluon.launch import _num_sms
from ..kernels.launch import split_buffers, splitk_reduce_call
from ..kernels.select import GLUON_ENV
from . import kernel as _kernel_module
from . import fp8_prefill, prefill
from .dequant import DEQUANT_MIN_M, DequantLaunch
from .layout import BLOCK_K, PrepackedInt4

_X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8",
            torch.float8_e5m2: "bf8"}
_DTYPE_OF = {v: k for k, v in _X_TYPES.items()}
_OUT = (torch.bfloat16, torch.float16, torch.float32)
NUM_SMS_DEFAULT = 132
ROWS = 64  # weight rows per program (kernel.BN)


@dataclass(frozen=True)
class Int4pConfig:
    """bm: tokens per program (wgmma N), split_k: programs along K, stages: pipeline depth."""

    bm: int
    split_k: int = 1
    stages: int = 3
    warps: int = 4
    maxnreg: int | None = None  # a register cap (ptxas): 128 lets four programs share an SM
    # Group scales loaded one K tile ahead (kernel.py's SCALE_AHEAD): the decode rule's choice
    # for 16-bit activations below the 128-register cap (``_scales_ahead``).
    scale_ahead: bool = False
    # fp8 activations converted to fp16 inside the kernel (exact: e4m3 and e5m2 values are fp16
    # values), the weight to fp16 and an fp16 wgmma, instead of bf16: one cvt per two activations
    # where bf16 goes through fp32. sm_90 build (``scripts/sass_loop.py --prepacked fp8e4nv 16
    # group --fp16``): 657 instructions per K tile against 753 (no F2F, no PRMT), 155 registers
    # against 168 with three stages. The decode rule's choice for fp8 activations (``decode_rule``,
    # timed there).
    fp16: bool = False
    # With split_k > 1: the kernel sums its partials itself (kernel.py's FIXUP: the last program
    # of a tile, by an atomic count), instead of a second launch of the reduction kernel.
    fixup: bool = False
    # Stream-K (kernel.py's STREAMK): as many programs as the SMs hold at once (``per_sm`` each),
    # each streaming an equal, contiguous range of the call's (tile, K block) units; tiles shared
    # by programs summed in the kernel. No split_k with it.
    streamk: bool = False

    def __post_init__(self):
        if self.streamk and (self.split_k > 1 or self.warps != 4):
            raise ValueError(f"stream-K (streamk=True) takes split_k 1 and 4 warps, not {self.split_k} / {self.warps}")

    @property
    def per_sm(self) -> int:
        """Programs of this config one sm_90 SM holds (registers and shared memory of the build,
        ``PER_SM_*``): 32-token tiles and three stages two, two stages three, capped at 128
        registers four."""
        if self.bm > 16 or self.stages >= 3:
            return PER_SM_S3
        return PER_SM_CAPPED if self.maxnreg is not None and self.maxnreg <= 128 else PER_SM_S2

    @property
    def in_kernel_sum(self) -> bool:
        """Whether the kernel sums split-K partials itself (``fixup`` with a split)."""
        return self.fixup and self.split_k > 1

    @classmethod
    def parse_tag(cls, tag: str) -> "Int4pConfig":
        """The inverse of ``tag`` (e.g. ``m64n16k512_w4_s2_sk4_r128_swap``)."""
        m = re.fullmatch(r"m(\d+)n(\d+)k512_w(\d+)_s(\d+)(?:_sk(\d+))?(?:_r(\d+))?(_pf)?(_h16)?(_fx)?(_stk)?_swap",
                         tag)
        if not m:
            raise ValueError(f"an int4p config tag like m64n16k512_w4_s2_sk4_swap, got {tag!r}")
        cfg = cls(int(m.group(2)), int(m.group(5) or 1), int(m.group(4)), int(m.group(3)),
                  int(m.group(6)) if m.group(6) else None, m.group(7) is not None, m.group(8) is not None,
                  m.group(9) is not None, m.group(10) is not None)
        if cfg.fixup and cfg.split_k == 1:
            raise ValueError(f"{tag!r}: _fx (the in-kernel split-K sum) needs a split over K")
        if cfg.rows != int(m.group(1)):
            raise ValueError(f"{tag!r}: {m.group(3)} warps hold {cfg.rows} weight rows, not {m.group(1)}")
        return cfg

    @property
    def rows(self) -> int:
        """Weight rows per program: one 64-row wgmma per warpgroup."""
        return ROWS * (self.warps // 4)

    @property
    def tag(self) -> str:
        sk = f"_sk{self.split_k}" if self.split_k > 1 else ""
        reg = f"_r{self.maxnreg}" if self.maxnreg else ""
        pf = "_pf" if self.scale_ahead else ""
        h16 = "_h16" if self.fp16 else ""
        fx = "_fx" if self.in_kernel_sum else ""
        stk = "_stk" if self.streamk else ""
        return f"m{self.rows}n{self.bm}k{BLOCK_K}_w{self.warps}_s{self.stages}{sk}{reg}{pf}{h16}{fx}{stk}_swap"


def kernel_ct(x_type: str, cfg: Int4pConfig) -> str:
    """The decode kernel's 16-bit compute type (its constexpr CT) for activations of ``x_type``:
    fp16 for fp16, and for fp8 ones with ``cfg.fp16``; else bf16. ``cfg.fp16`` with 16-bit
    activations is an error (bf16 values are not all fp16 values; fp16 ones already run fp16)."""
    if cfg.fp16 and x_type not in ("fp8", "bf8"):
        raise ValueError(f"Int4pConfig(fp16=True) is for fp8 activations, not {x_type}")
    return "fp16" if x_type == "fp16" or cfg.fp16 else "bf16"


_TUNED_PATH = os.path.join(os.path.dirname(__file__), "data", "tuned_sm90.json")


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    """{(n, k, 1 or 16): config} measured on an H200 (data/tuned_sm90.json, its 'about' says how)."""
    with open(_TUNED_PATH) as f:
        doc = json.load(f)
    return {(e["n"], e["k"], e["m"]): Int4pConfig.parse_tag(e["config"]) for e in doc["entries"]}


def config_for(m: int, n: int, k: int, x_type: str = "bf16", num_sms: int = NUM_SMS_DEFAULT
               ) -> tuple[Int4pConfig, str]:
    """(config, where it came from): the tuned table for the weights and decode sizes it lists
    (M = 1; M 2-16) with 16-bit activations (it was measured with bf16; fp16 runs the same
    code), else the heuristic (``decode_rule``; its reason follows "heuristic: "). fp8
    activations take the heuristic, which has its own measured branch for them (the table was
    timed with bf16)."""
    if m <= 16 and x_type in ("bf16", "fp16"):
        hit = tuned_table().get((n, k, 1 if m == 1 else 16))
        if hit is not None:
            return hit, "tuned table"
    cfg, why = decode_rule(m, n, k, x_type, num_sms)
    return cfg, f"heuristic: {why}"


def default_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT, x_type: str = "bf16"
                   ) -> Int4pConfig:
    """The heuristic's config (``decode_rule`` without its reason)."""
    return decode_rule(m, n, k, x_type, num_sms)[0]


# Programs of the 16-token decode kernel one SM holds on sm_90 (bf16/fp16 activations; the fp8
# branch uses the same bands; registers and shared memory of the sm_90 build,
# scripts/sass_loop.py --prepacked): three stages take 80 KB
# of shared memory (two programs); two stages 48 KB and 168 registers (three, by registers); two
# stages under a 128-register cap four (ptxas spills two values that the K loop reloads).
PER_SM_S3, PER_SM_S2, PER_SM_CAPPED = 2, 3, 4


def decode_rule(m: int, n: int, k: int, x_type: str = "bf16", num_sms: int = NUM_SMS_DEFAULT,
                streamk: bool = True) -> tuple[Int4pConfig, str]:
    """(config, why): the decode rule measured on an H200 (bench/results/h200/int4/), below
    (``_decode_tiles``); fp8 activations converted to fp16 in the kernel (``Int4pConfig.fp16``).
    Timed on an H200 (18 weights, e4m3, the rule's config both ways in one run): 1.10x faster
    than converting to bf16 at M = 1 and 16 (median of 36, 1.05-1.14x; int4/fp16-decode/), 1.10x
    at M = 4 and 8 (median of 36; int4/fp16-routed/), 1.27x and 1.29x at 32-224 tokens (medians
    of 72 and 36, both runs; from 33 tokens a call this kernel takes is cast to bf16 first,
    ``compute_type``). A split over K sums its partials in the kernel (``Int4pConfig.fixup``): on
    an H200 (int4/fixup/, 13 weights split per M, one run, e4m3 on 10) 1.04x / 1.06x / 1.10x /
    1.09x / 1.23x faster than the reduction kernel at M = 1 / 4 / 16 / 24 / 32 (medians; W4A8
    1.04-1.22x), slower on 3 of 63 W4A16 calls (0.94x, 0.96x: two M = 1 configs of the tuned
    table, which keep the reduction kernel; 0.996x). With 16-bit activations, tiles that leave
    the last wave at most a quarter full take stream-K (``_streamk_tail``; ``streamk=False``: the
    rule without that step)."""
    cfg, why = _decode_tiles(m, n, k, x_type, num_sms)
    if streamk and x_type in ("bf16", "fp16"):
        cfg, why = _streamk_tail(cfg, m, n, num_sms, why)
    if cfg.split_k > 1:
        cfg, why = replace(cfg, fixup=True), f"{why}; the partials summed in the kernel"
    if x_type in ("fp8", "bf8"):
        return replace(cfg, fp16=True), f"{why}; {x_type} converted to fp16"
    return cfg, why


def _decode_tiles(m: int, n: int, k: int, x_type: str, num_sms: int) -> tuple[Int4pConfig, str]:
    """The decode kernel's tiles, split over K, stages and register cap (``decode_rule``).

    Up to M = 16: 16-token tiles; K split by powers of two until the programs cover the SMs 1.5
    times (each keeping at least two K tiles), at M = 1 with 16-bit activations further while
    four programs per SM still hold them all. Then the stages by how many programs each SM must
    hold for one wave (``PER_SM_*``): up to 2 three stages, up to 3 two stages, up to 4 two
    stages under a 128-register cap (at M > 1 only without split-K); beyond that the cap at
    M = 1, three stages above. Every such config not capped at 128 registers loads the group
    scales one K tile ahead under a 168-register cap (``_scales_ahead``). fp8 activations (W4A8)
    follow the M = 1 branches at every M up to 16 (the further split; the cap with split-K up to
    4 programs per SM), except beyond 4 per SM, where M > 1 keeps three stages: swept on an H200 (int4/w4a8-rule/, 18 weights
    x M 1, 4, 16, 29 configs each), this rule ran 1.074x faster than three stages with the
    1.5-waves split (median of 54, none slower) and matched the fastest swept config (median);
    the 16-bit rule as it stands, 1.061x.
    Above M = 16: 32-token tiles with two stages (a 64-token tile needs 254 registers and fits
    one program per SM), the same 1.5-waves split.

    Evidence (int4/int4.csv: 11 weights at M = 1 and 16, split-K 1-8 x {three stages, two, two
    capped}; int4/maxnreg_rule.md, scripts/int4_decode_rule.py). At the same split, by programs
    per SM: up to 2, two stages took 1.09-1.56x three stages' time (34 pairs); from 2 to 3,
    0.83-0.94x (8 pairs; the previous kernel's sweep int4_sweep_m1-64.csv repeats both bands);
    from 3 to 4 without split-K the cap 0.73-0.77x of two stages and 0.90-0.92x of three. At M = 1
    the cap beat three stages in all 14 split-K pairs above 3 per SM; at M = 16 capped split-K
    configs were slower than two stages uncapped in 25 of 27 pairs (up to 1.25x), hence M = 1.
    Against three stages everywhere (the rule before) on the 22 problems: median 1.07x faster,
    none slower, within 1% of the fastest swept config on 18 (at most 1.20x off: 544 programs
    at M = 1, where a 4-way split with the cap was fastest)."""
    rows = -(-n // ROWS)
    ktiles = -(-k // BLOCK_K)
    sixteen = x_type in ("bf16", "fp16")
    bm = 16 if m <= 16 else 32
    tiles = rows * -(-m // bm)
    split = 1
    while 2 * tiles * split < 3 * num_sms and ktiles >= 4 * split:
        split *= 2
    if bm == 32:
        return Int4pConfig(32, split, 2), (f"{m} tokens: 32-token tiles, two stages, {tiles * split} "
                                           f"programs (split-K {split})")
    # fp8 activations take the M = 1 branches at every decode M (the further split, the cap with
    # split-K): their capped split-K configs won at M = 4 and 16 where bf16's lost.
    like_m1 = m == 1 or not sixteen
    if like_m1:
        while 2 * tiles * split <= PER_SM_CAPPED * num_sms and ktiles >= 4 * split:
            split *= 2
    programs = tiles * split
    what = f"{programs} programs ({rows} row tiles x split-K {split})"
    if programs <= PER_SM_S3 * num_sms:
        return _scales_ahead(Int4pConfig(16, split, 3), f"{what}, up to {PER_SM_S3} per SM: three stages")
    if programs <= PER_SM_S2 * num_sms:
        return _scales_ahead(Int4pConfig(16, split, 2), f"{what}, up to {PER_SM_S2} per SM: two stages")
    capped = Int4pConfig(16, split, 2, 4, 128)
    if programs <= PER_SM_CAPPED * num_sms and (like_m1 or split == 1):
        return capped, f"{what}, up to {PER_SM_CAPPED} per SM: two stages, registers capped at 128"
    if m == 1:
        return capped, f"{what}, over {PER_SM_CAPPED} per SM: at M = 1 two stages, registers capped at 128"
    return _scales_ahead(Int4pConfig(16, split, 3), f"{what}, over {PER_SM_CAPPED} per SM: three stages")


STREAMK_TAIL = 0.25  # the fullest last wave (a fraction of the SMs' slots) that stream-K replaces
# stream-K's 16-token config: two programs per SM, three stages, scales ahead under 168 registers
STREAMK_CONFIG = Int4pConfig(16, 1, 3, 4, 168, True, streamk=True)


def _streamk_tail(cfg: Int4pConfig, m: int, n: int, num_sms: int, why: str) -> tuple[Int4pConfig, str]:
    """Stream-K (``Int4pConfig.streamk``) for an unsplit config whose tiles fill more than one
    wave of its occupancy band and leave the last wave at most ``STREAMK_TAIL`` full: two programs
    per SM (three stages under a 168-register cap with the group scales ahead; 32-token tiles,
    two stages), each streaming an equal share of the (tile, K block) units. Timed on an H200
    (bench/results/h200/int4/streamk-decode/, 18 weights x M 1 / 4 / 16 / 32, stream-K at each
    band beside the rule's config): over all calls its best band ran at 0.90 / 0.94 / 0.92 / 1.01x
    the rule's speed (medians; it loses on small, split weights, down to 0.78x). Where the last
    wave was at most a quarter full (576 and 592 tiles at M = 1: 1.09 and 1.12 waves of four
    programs per SM; at M = 4 and 16: 2.18 and 2.24 waves of two; 32 tokens: 2.06-2.24 waves) this
    config ran 1.05-1.21x faster on 7 of those 9 calls and 0.97 / 0.99x on two. Out of sample
    (int4/streamk-decode-routed/: M 2 / 8 / 12 / 24, and Phi-3-medium and Yi-34B gate_up): 15 of 15
    calls faster, 1.03-1.22x (median 1.12)."""
    if cfg.split_k > 1 or cfg.streamk:
        return cfg, why
    tiles = -(-n // cfg.rows) * -(-m // cfg.bm)
    waves = tiles / (cfg.per_sm * num_sms)
    if waves <= 1 or waves - int(waves) == 0 or waves - int(waves) > STREAMK_TAIL:
        return cfg, why
    stk = STREAMK_CONFIG if cfg.bm == 16 else Int4pConfig(cfg.bm, 1, 2, streamk=True)
    return stk, (f"{why}; {waves:.2f} waves of {cfg.per_sm} per SM (last one at most {STREAMK_TAIL} full): "
                 f"stream-K over {stk.per_sm * num_sms} programs")


# W4A8 on the decode kernel: the fp8 activations cast to bf16 first (exact), then the W4A16
# kernel. The kernel converts fp8 activations itself, but it must then write them back to shared
# memory for the wgmma: eight barriers per K tile on the sm_90 build (scripts/sass_loop.py
# --prepacked fp8e4nv: LDS 39, F2F 64, BAR 8 against none with bf16). The separate cast costs a
# launch (2-4 us in a CUDA graph). H200, 18 weights, the kernel converting to fp16
# (``decode_rule``) against the cast, one run per line (bench/results/h200/int4/):
# - M = 1 and 16 (fp16-decode/): the kernel won on every weight up to 67.9 MB of int4 (1.02-1.10x)
#   and won or lost by up to 4% from 83.9 MB (one weight 0.86x at M = 1); at M = 4 and 8
#   (fp16-routed/) 0.98-1.12x from 83.9 MB;
# - M = 32 (32-token tiles; fp16-routed/): the kernel won on every weight up to 33.9 MB (1.07-1.23x),
#   tied from 44.6 to 67.9 MB (0.98-1.03x) and lost from 83.9 MB (0.94-1.00x); at M = 24
#   (fp16-checks/) it lost on every weight from 44.6 MB (0.81-0.91x);
# - converting to bf16 it lost from 44.6 MB at M <= 16 (int4/split-cost/, int4/fp8-prefill/), and at
#   M = 48 and 128 on all 18 (0.68-0.96x, median 0.78 / 0.73).
W4A8_CAST_MIN_BYTES = 75_000_000  # up to 16 tokens
W4A8_CAST_MIN_BYTES_32 = 40_000_000  # 17-32 tokens
W4A8_CAST_MAX_M = 32  # the decode sizes where the weight's size decides; above, always cast


def cast_min_bytes(m: int) -> int:
    """The int4 bytes from which fp8 activations of ``m`` tokens (at most W4A8_CAST_MAX_M) are cast
    to bf16 for the decode kernel."""
    return W4A8_CAST_MIN_BYTES if m <= 16 else W4A8_CAST_MIN_BYTES_32


def compute_type(m: int, n: int, k: int, x_type: str) -> str:
    """The activation type the decode kernel runs for ``x_type``: fp8 cast to 'bf16' above
    ``W4A8_CAST_MAX_M`` tokens, or at fewer for weights of ``cast_min_bytes(m)`` of int4 and
    more; else ``x_type`` itself."""
    if x_type in ("fp8", "bf8") and (m > W4A8_CAST_MAX_M or n * k // 2 >= cast_min_bytes(m)):
        return "bf16"
    return x_type


def _scales_ahead(cfg: Int4pConfig, why: str) -> tuple[Int4pConfig, str]:
    """16-token tiles (16-bit or fp8 activations) not capped at 128 registers: group scales loaded one
    K tile ahead (``scale_ahead``) under a 168-register cap. Timed on an H200 (44 problems, M 1-16,
    bench/results/h200/int4/scale-ahead/): a config with them ran 1.06x faster than without
    (median of 716 pairs), and this rule came within 0.6% of the fastest swept config (median;
    the rule without them: 6.7%). Uncapped, the split two-stage configs with them lost up to 1.3x
    at M = 1 and 16 (168 registers cap what ptxas took); capped at 128 they spill (80 B)."""
    return replace(cfg, maxnreg=168, scale_ahead=True), f"{why}; group scales one K tile ahead (168 registers)"


_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp8": "*fp8e4nv", "bf8": "*fp8e5"}


def compile_source(x_type: str, w_scale: str, cfg: Int4pConfig, *, x_scale: str | None = None,
                   group_k: int = 128, has_bias: bool = False, even_k: bool = True):
    """The kernel as ``triton.compile`` takes it for an ahead-of-time build (``tileq build``,
    ``scripts/sass_loop.py --prepacked``): bf16 output, the specialization a JIT launch makes for
    LLM shapes (16-byte aligned pointers, N, K and strides multiples of 16)."""
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
                  STREAMK=cfg.streamk)
    return triton.compiler.ASTSource(fn=_kernel_module._i4p_kernel, signature=sig, constexprs=consts,
                                     attrs=attrs)


def compile_options(cfg: Int4pConfig) -> dict:
    opts = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return opts


# The weight scales each scheme means for a prepacked weight (names, explain, the catalog build).
W_SCALE_OF_SCHEME = {"bquant": "group", "rowcol": "vector", "tensor": "scalar"}
_SCHEME_OF_W_SCALE = {v: k for k, v in W_SCALE_OF_SCHEME.items()}


def kernel_name(x_type: str, w_scale: str, cfg: Int4pConfig) -> str:
    scheme = _SCHEME_OF_W_SCALE[w_scale]
    pipeline = "decode" if cfg.bm <= 64 else "prefill"
    return f"{scheme}_{x_type}xi4p_rcr_{pipeline}__{cfg.tag}_sm90"


def _scale_kind(t, what: str) -> str:
    return "scalar" if t.numel() == 1 else what


class Int4pLaunch:
    """One call signature bound to its kernel launch (and split-K reduction)."""

    def __init__(self, m, n, k, x_type, out_dtype, w_scale_kind, sw_strides, x_scale_kind, sx_stride,
                 group_k, has_bias, device, cfg: Int4pConfig, cast_x: bool = False):
        # cast_x: the call's activations (fp8) are cast to x_type (bf16) before the kernel.
        self.m, self.n, self.out_dtype, self.device, self.cfg = m, n, out_dtype, device, cfg
        self.cast_to = _DTYPE_OF[x_type] if cast_x else None
        self.interpreted = interpreter_active()
        self.direct = device.type == "cuda" and not self.interpreted
        ct = kernel_ct(x_type, cfg)
        tiles = -(-n // cfg.rows) * -(-m // cfg.bm)
        # stream-K: a program per slot the SMs hold, at most one per (tile, K block) unit
        programs = min(cfg.per_sm * _num_sms(device), tiles * -(-k // BLOCK_K)) if cfg.streamk else 0
        grid = (programs, 1) if cfg.streamk else (tiles, cfg.split_k)
        ints = (m, n, k, k, n, sw_strides[0], sw_strides[1], sx_stride)
        consts = dict(CT=ct, W_SCALE=w_scale_kind, X_SCALE=x_scale_kind, GROUP_K=group_k,
                      HAS_BIAS=has_bias, BM=cfg.bm, SPLIT_K=cfg.split_k, EVEN_K=k % BLOCK_K == 0,
                      INTERPRETED=self.interpreted, BN=cfg.rows, SCALE_AHEAD=cfg.scale_ahead,
                      FIXUP=cfg.in_kernel_sum, STREAMK=cfg.streamk, num_warps=cfg.warps, num_stages=cfg.stages)
        if cfg.maxnreg and not self.interpreted:
            consts["maxnreg"] = cfg.maxnreg
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
                               (torch.int32, _DTYPE_OF[x_type], out_dtype, torch.float32, torch.float32, torch.float32,
                                torch.float32 if self.partials else None, torch.int32 if self.counters else None))
        self.reduce = None
        if cfg.split_k > 1 and not cfg.in_kernel_sum:
            self.reduce = splitk_reduce_call(n, m, n, cfg.split_k, out_dtype, swapped=True)

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


_LAUNCHES: dict[tuple, Int4pLaunch] = {}


def _check_scales(x_type, m, n, k, x_scale, w_scale, group_k):
    if w_scale is None:
        raise DTypeError(expect("w_scale", "the int4 weight's scales ([K/group_k, N], [N] or one value)", None))
    if not isinstance(w_scale, torch.Tensor) or not w_scale.dtype.is_floating_point:
        raise DTypeError(expect("w_scale", "a floating-point tensor", type(w_scale).__name__))
    if group_k % 128 or group_k <= 0:
        raise ShapeError(expect("group_k", "a positive multiple of 128 for prepacked int4 weights", group_k))
    gk = -(-k // group_k)
    if w_scale.numel() == 1:
        w_kind = "scalar"
    elif w_scale.dim() == 2 and tuple(w_scale.shape) == (gk, n) and gk > 1:
        w_kind = "group"
    elif tuple(w_scale.shape) in ((n,), (1, n)):
        w_kind = "vector"
    else:
        raise ShapeError(expect("w_scale", f"[{gk}, {n}] (group_k={group_k}), [{n}] or one value",
                                tuple(w_scale.shape)))
    if x_type in ("bf16", "fp16"):
        if x_scale is not None:
            raise DTypeError(expect("x_scale", "None for 16-bit activations", type(x_scale).__name__))
        return w_kind, "none"
    if x_scale is None or not isinstance(x_scale, torch.Tensor):
        raise DTypeError(expect("x_scale", "a tensor of per-token ([M] / [M, 1]) or per-tensor scales",
                                type(x_scale).__name__))
    if x_scale.numel() == 1:
        return w_kind, "scalar"
    if tuple(x_scale.shape) not in ((m,), (m, 1)):
        raise ShapeError(expect("x_scale", f"[{m}] or [{m}, 1] (per token) or one value", tuple(x_scale.shape)))
    return w_kind, "vector"


def _f32(t):
    return t if t is None or t.dtype == torch.float32 else t.float()


def linear_prepacked(x: torch.Tensor, w: PrepackedInt4, x_scale=None, w_scale=None, *,
                     out_dtype: torch.dtype | None = None, bias=None, group_k: int = 128,
                     config: Int4pConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for a prepacked int4 weight W [N, K]; x [..., K] (leading dims flattened)."""
    prepared = _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, config)
    if isinstance(prepared, torch.Tensor):  # nothing to launch (M, N or K is 0)
        return prepared
    launch, x2, sx, sw, b, lead = prepared
    if out is not None:
        _check_out(out, x2.shape[0], w.shape[0], launch.out_dtype, x.device)
    y = launch(x2, w.data, sx, sw, b, None if out is None else out.view(x2.shape[0], w.shape[0]))
    return y.view(*lead, w.shape[0])


def _check_out(out: torch.Tensor, m: int, n: int, out_dtype: torch.dtype, device: torch.device) -> None:
    """The same checks whichever path runs the call: every path writes [M, N] rows of N in place."""
    if out.dtype != out_dtype:
        raise DTypeError(expect("out", f"a {out_dtype} tensor (out_dtype)", out.dtype))
    if out.device != device or out.numel() != m * n or out.shape[-1] != n or not out.is_contiguous():
        raise ShapeError(expect("out", f"a contiguous tensor of {m} x {n} values on {device}",
                                f"{tuple(out.shape)} on {out.device}"))


def _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, config):
    """Check a call and find (or make) its launch: (launch, x2, x_scale, w_scale, bias, lead) with
    the scales and bias in fp32, or the finished result when there is nothing to launch."""
    if not isinstance(w, PrepackedInt4):
        raise DTypeError(expect("w", "a tileq.PrepackedInt4", type(w).__name__))
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_TYPES:
        raise DTypeError(expect("x", "a bf16, fp16, fp8 e4m3 or e5m2 tensor",
                                getattr(x, "dtype", type(x).__name__)))
    n, k = w.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ShapeError(expect("x", f"[..., {k}] (the weight's K)", tuple(x.shape)))
    if x.device != w.device:
        raise DTypeError(expect("x", f"on the weight's device {w.device}", x.device))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if k and x2.stride(1) != 1:
        raise ShapeError(expect("x", "unit stride along K", f"strides {tuple(x.stride())}"))
    m = x2.shape[0]
    x_type = _X_TYPES[x.dtype]
    if out_dtype is None:
        out_dtype = x.dtype if x_type in ("bf16", "fp16") else torch.bfloat16
    if out_dtype not in _OUT:
        raise DTypeError(expect("out_dtype", "bf16, fp16 or fp32", out_dtype))
    if x_scale is not None and isinstance(x_scale, torch.Tensor) and x_scale.numel() == m and m > 1:
        x_scale = x_scale.reshape(m)
    w_kind, x_kind = _check_scales(x_type, m, n, k, x_scale, w_scale, group_k)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
        raise ShapeError(expect("bias", f"[{n}]", tuple(getattr(bias, "shape", ()))))
    if m == 0 or n == 0:
        return torch.empty(*lead, n, dtype=out_dtype, device=x.device)
    if k == 0:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        if bias is not None:
            y += bias.float()
        return y.to(out_dtype).view(*lead, n)
    sw = _f32(w_scale)
    sx = _f32(x_scale)
    b = _f32(bias)
    if w_kind == "group":
        sw_strides = (sw.stride(0), sw.stride(1))
    elif w_kind == "vector":
        sw_strides = (0, sw.stride(-1))
    else:
        sw_strides = (0, 0)
        sw = sw.reshape(())
    sx_stride = sx.stride(0) if x_kind == "vector" else 0
    if x2.stride(0) != k and m > 1:
        raise ShapeError(expect("x", "rows of stride K (a contiguous [..., K] tensor)", tuple(x.stride())))
    # M >= DEQUANT_MIN_M: a prefill path (the Gluon kernel where it serves, else dequantize +
    # cuBLAS); below, the Gluon kernel where it serves and prefill.plan gives it the call (a
    # split over K, or the tiles to fill the SMs), else the decode kernel.
    dequant = config is None and m >= DEQUANT_MIN_M
    # (decode sizes skip the SM query on their per-call path)
    gluon_plan = (prefill.plan(m, n, k, _num_sms(x.device), x_kind != "none")
                  if config is None and m >= prefill.MIN_M else None)
    small_prefill = not dequant and gluon_plan is not None
    # (a given config runs the kernel of the call's own activation type)
    ct = x_type if config is not None else compute_type(m, n, k, x_type)
    cfg = None if dequant or small_prefill else (config or config_for(m, n, k, ct)[0])
    key = (m, n, k, x_type, ct, out_dtype, w_kind, sw_strides, x_kind, sx_stride, group_k, b is not None,
           x2.stride(0), x.device, cfg, interpreter_active(), os.environ.get(GLUON_ENV),
           os.environ.get(fp8_prefill.PREFILL_ENV))
    launch = _LAUNCHES.get(key)
    if launch is None:
        # (read for every W4A8 prefill call, so that a wrong value is an error wherever the call goes)
        w4a8_mode = fp8_prefill.mode() if x_kind != "none" and m >= prefill.MIN_M else None
        fp8_values = dequant and x_kind != "none" and w4a8_mode != "bf16"
        fused = w4a8_mode is not None and fp8_prefill.fused_for(m, x_type, w_kind, n, k)
        # (the key holds what unserved() reads: the device, the interpreter, TILEQ_GLUON)
        served = (dequant or small_prefill) and prefill.unserved(
            m, k, x_type, x_kind, w_kind, out_dtype, x.device, gluon_plan[0] if gluon_plan else None,
            fused) is None
        if served:
            tokens, split = gluon_plan
            tokens, streamk = prefill.streamk_for(m, n, k, tokens, split, _num_sms(x.device), x_kind != "none")
            launch = prefill.GluonPrefillLaunch(m, n, k, x.dtype, out_dtype, w_kind, sw_strides, group_k,
                                                b is not None, x.device,
                                                DequantLaunch(n, k, w_kind, x_kind, sw_strides, group_k, out_dtype,
                                                              x.dtype), tokens=tokens, split=1 if streamk else split,
                                                x_kind=x_kind, sx_stride=sx_stride, fused=fused, streamk=streamk)
        elif fp8_values:
            launch = fp8_prefill.Fp8PrefillLaunch(n, k, w_kind, x_kind, group_k, out_dtype, x.dtype)
        elif dequant:
            launch = DequantLaunch(n, k, w_kind, x_kind, sw_strides, group_k, out_dtype, x.dtype)
        else:  # (a small-M call the prefill kernel does not serve takes the decode kernel)
            cfg = cfg or config_for(m, n, k, ct)[0]
            launch = Int4pLaunch(m, n, k, ct, out_dtype, w_kind, sw_strides, x_kind, sx_stride, group_k,
                                 b is not None, x.device, cfg, cast_x=ct != x_type)
        bounded_put(_LAUNCHES, key, launch, 1024)
    return launch, x2, sx, sw, b, lead


def describe_prepacked(m: int, n: int, k: int, x_dtype: torch.dtype = torch.bfloat16,
                       w_scale: str = "group", config: Int4pConfig | None = None,
                       device: torch.device | None = None) -> str:
    """What ``linear_prepacked`` runs for these sizes: the decode kernel's name (its config in the
    tag) and where the config came from (tuned table, or the heuristic and its reason), or from
    ``prefill.MIN_M`` tokens the sm_90 Gluon prefill kernel where it serves the call on ``device``
    (without a device, on an sm_90 GPU), from ``DEQUANT_MIN_M`` tokens the fp8 GEMM on the values
    (W4A8) or dequantize + cuBLAS where it does not."""
    sms = _num_sms(device) if device is not None else NUM_SMS_DEFAULT
    x_type = _X_TYPES[x_dtype]
    x_kind = "none" if x_type in ("bf16", "fp16") else "vector"
    gluon_plan = prefill.plan(m, n, k, sms, x_kind != "none") if config is None else None
    if config is None and (m >= DEQUANT_MIN_M or gluon_plan is not None):
        out = x_dtype if x_type in ("bf16", "fp16") else torch.bfloat16
        tokens = gluon_plan[0] if gluon_plan else None
        fused = x_kind != "none" and fp8_prefill.fused_for(m, x_type, w_scale, n, k)
        why = (prefill.unserved(m, k, x_type, x_kind, w_scale, out, device, tokens, fused)
               if device is not None else prefill.unserved_on_sm90(m, k, x_type, w_scale, tokens, fused))
        if why is None:
            t, split = gluon_plan
            t_sk, streamk = prefill.streamk_for(m, n, k, t, split, sms, x_kind != "none")
            tiles = prefill.tiles(m, n, t)
            if streamk:
                s = prefill.streamk_schedule(prefill.tiles(m, n, t_sk), k, sms)
                when = (f"stream-K: {s.dp} whole tiles of {t_sk} tokens, then {s.per} of the other {s.units} "
                        f"(tile, K block) units per SM: {prefill.streamk_cost(m, n, k, t_sk, sms):.1f} K blocks "
                        f"per SM one after another against {prefill.plan_cost(m, n, k, t, split, sms):.1f} with "
                        f"{tiles} tiles of {t} tokens{f' split over K {split} ways' if split > 1 else ''} "
                        f"(x {prefill.STREAMK_MARGIN} needed)")
                t, split = t_sk, 1
            elif split > 1:
                when = (f"{tiles} tiles of {t} tokens for {sms} SMs, at most {prefill.SPLIT_FILL} x SMs: "
                        f"split over K {split} ways")
            elif m >= DEQUANT_MIN_M and t == 256:
                when = (f"M >= {prefill.T256_MIN_M}: {prefill.waves(m, n, 256, sms)} waves of 256-token tiles "
                        f"(x {prefill.TILE256_COST}) against {prefill.waves(m, n, 128, sms)} of 128-token ones")
            elif m >= DEQUANT_MIN_M:
                when = f"M >= {DEQUANT_MIN_M}"
            else:
                when = f"M >= {prefill.MIN_M} with {prefill.tiles(m, n, 64)} tiles of 64 tokens for {sms} SMs"
            cast = ""
            if fused:
                cast = ("; its fp8 build: the fp8 activations as they are, the weight converted to e4m3, fp8 "
                        "wgmma promoted every 128 of K, their scale in the epilogue")
                if m >= prefill.W4A8_MAX_M and fp8_prefill.mode() == "fp8":
                    cast += f"; from {prefill.W4A8_MAX_M} tokens only {fp8_prefill.fused_wide_rule()}"
            elif x_kind != "none":
                cast = f"; {x_type} activations cast to bf16 first, their scale in the epilogue"
            ct_name = "fp8" if fused else ("bf16" if cast else x_type)
            overlap = " (the next slice while this one's wgmmas run)" if prefill.overlap_for(ct_name, t) else ""
            xs = x_kind != "none" and not fused  # (the 16-bit build with the activations' scale)
            return (f"{prefill.kernel_name(ct_name, w_scale, t, split, streamk, xs)} ({when}: the sm_90 "
                    f"Gluon prefill kernel, {t}-token x 128-row tiles, int4 converted in registers"
                    f"{overlap}{cast})")
        if m >= DEQUANT_MIN_M and x_kind != "none" and fp8_prefill.selected():
            return (f"{fp8_prefill.Fp8PrefillLaunch.name} (M >= {DEQUANT_MIN_M}, "
                    f"W4A8: W's int4 values written as {x_type}, then tileq's fp8 "
                    f"{'bquant' if w_scale == 'group' else 'rowcol'} GEMM with its scales; "
                    f"not the Gluon prefill kernel: {why})")
        if m >= DEQUANT_MIN_M:
            also = f"; {fp8_prefill.PREFILL_ENV}=bf16" if x_kind != "none" else ""
            return (f"dequant+cublas (M >= {DEQUANT_MIN_M}: W dequantized to 16 bits, then a cuBLAS product; "
                    f"not the Gluon prefill kernel: {why}{also})")
    ct = x_type if config else compute_type(m, n, k, x_type)
    cfg, source = (config, "given config") if config else config_for(m, n, k, ct)
    if ct != x_type:
        why = (f"M > {W4A8_CAST_MAX_M}" if m > W4A8_CAST_MAX_M else
               f"{n * k // 2 / 1e6:.1f} MB of int4 >= {cast_min_bytes(m) / 1e6:.0f} MB")
        source = f"{x_type} activations cast to {ct} first: {why}; {source}"
    return f"{kernel_name(ct, w_scale, cfg)} ({source})"


class PrepackedCall:
    """A kept launch for one call signature: ``run(x, w_storage, x_scale, w_scale, bias, acc,
    out)`` as ``api.linear_call``'s objects, with no per-call checks (QuantLinear's runner)."""

    __slots__ = ("launch",)

    def __init__(self, launch: Int4pLaunch):
        self.launch = launch

    def run(self, x, wdata, x_scale, w_scale, bias, acc, out):
        return self.launch(x, wdata, x_scale, w_scale, bias, out)


def prepacked_call(x, w: PrepackedInt4, x_scale, w_scale, *, out_dtype, bias, group_k):
    """The kept launch of ``linear_prepacked`` for x [M, K] on a GPU, or None (CPU, interpreter,
    scales or bias not already fp32: those take ``linear_prepacked`` every call)."""
    if x.dim() != 2 or x.device.type != "cuda" or interpreter_active():
        return None
    if any(t is not None and t.dtype != torch.float32 for t in (x_scale, w_scale, bias)):
        return None
    prepared = _prepare(x, w, x_scale, w_scale, out_dtype, bias, group_k, None)
    return None if isinstance(prepared, torch.Tensor) else PrepackedCall(prepared[0])
