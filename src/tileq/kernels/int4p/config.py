"""The decode kernel's configs (``kernel.py``): what a config holds, its tag and instance name, and
what one sm_90 SM holds of it. Facts of the kernel and its build, not choices: the decode rule in
``tileq.dispatch.int4`` picks a config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ...prepacked import BLOCK_K

# The activations' dtypes the prepacked kernels take, by the short name of their kernels.
X_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "bf8"}
DTYPE_OF = {v: k for k, v in X_TYPES.items()}
ROWS = 64  # weight rows per program and warpgroup (kernel.BN)
# The decode kernel's token tiles (BM) with their occupancy below: 16 and 32 tokens (a 64-token
# tile builds too but needs 254 registers: one program per SM).
DECODE_TOKEN_TILES = (16, 32)

# Programs of the 16-token decode kernel one sm_90 SM holds (registers and shared memory of the
# sm_90 build, `tileq sass --prepacked`): three stages take 80 KB of shared memory (two
# programs); two stages 48 KB and 168 registers (three, by registers); two stages under a
# 128-register cap four (ptxas spills two values that the K loop reloads).
PER_SM_S3, PER_SM_S2, PER_SM_CAPPED = 2, 3, 4
REGS_CAPPED = 128  # the register cap under which four programs fit one SM
REGS_AHEAD = 168  # the register cap of the configs loading group scales one K tile ahead (no spills)


@dataclass(frozen=True)
class Int4pConfig:
    """bm: tokens per program (wgmma N), split_k: programs along K, stages: pipeline depth."""

    bm: int
    split_k: int = 1
    stages: int = 3
    warps: int = 4
    maxnreg: int | None = None  # a register cap (ptxas): 128 lets four programs share an SM
    # Group scales loaded one K tile ahead (kernel.py's SCALE_AHEAD).
    scale_ahead: bool = False
    # fp8 activations converted to fp16 inside the kernel (exact: e4m3 and e5m2 values are fp16
    # values), the weight to fp16 and an fp16 wgmma, instead of bf16: one cvt per two activations
    # where bf16 goes through fp32 (sm_90 build: 657 instructions per K tile against 753).
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
        return PER_SM_CAPPED if self.maxnreg is not None and self.maxnreg <= REGS_CAPPED else PER_SM_S2

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


# The weight scales each scheme means for a prepacked weight (names, explain, the catalog build).
W_SCALE_OF_SCHEME = {"bquant": "group", "rowcol": "vector", "tensor": "scalar"}
SCHEME_OF_W_SCALE = {v: k for k, v in W_SCALE_OF_SCHEME.items()}


def kernel_name(x_type: str, w_scale: str, cfg: Int4pConfig) -> str:
    """The decode kernel's instance name: scheme, activation type x prepacked int4, rcr, the
    pipeline, the config's tag, sm90."""
    scheme = SCHEME_OF_W_SCALE[w_scale]
    pipeline = "decode" if cfg.bm <= 64 else "prefill"
    return f"{scheme}_{x_type}xi4p_rcr_{pipeline}__{cfg.tag}_sm90"
