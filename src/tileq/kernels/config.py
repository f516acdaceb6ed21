"""Tile configurations and the ONE legality predicate (heuristic, tuner and tests share it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..dtypes import OperandType, compute_type
from .select import orientation
from ..problem import ProblemSpec
from ..device import ArchInfo


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    group_m: int = 8
    # Compute C^T = B^T A^T (block_m then tiles N, block_n tiles M): the weight becomes the
    # mma's A operand (int4 unpacked without a transpose) and a small M fills the N side.
    swap_ab: bool = False

    @property
    def tag(self) -> str:
        """Name fragment: m128n128k128_w8_s4 (+ _sk4 when split over K, + _swap when swapped)."""
        t = f"m{self.block_m}n{self.block_n}k{self.block_k}_w{self.num_warps}_s{self.num_stages}"
        t += f"_sk{self.split_k}" if self.split_k > 1 else ""
        return t + ("_swap" if self.swap_ab else "")

    @classmethod
    def parse_tag(cls, tag: str) -> "TileConfig":
        m = _TAG.fullmatch(tag)
        if not m:
            raise ValueError(f"config tag: expected m<BM>n<BN>k<BK>_w<W>_s<S>[_sk<SK>][_swap], got {tag!r}")
        bm, bn, bk, w, s, sk, swap = m.groups()
        return cls(int(bm), int(bn), int(bk), int(w), int(s), int(sk) if sk else 1,
                   swap_ab=bool(swap))


_TAG = re.compile(r"m(\d+)n(\d+)k(\d+)_w(\d+)_s(\d+)(?:_sk(\d+))?(_swap)?")

_STORAGE_BYTES = {
    OperandType.I8: 1.0, OperandType.FP8: 1.0, OperandType.BF8: 1.0, OperandType.I4: 0.5,
    OperandType.BF16: 2.0, OperandType.FP16: 2.0,
}


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def smem_estimate(spec: ProblemSpec, cfg: TileConfig) -> int:
    """Bytes of shared memory: pipelined stored tiles, plus a converted copy when types change."""
    a_tile = cfg.block_m * cfg.block_k
    b_tile = cfg.block_k * cfg.block_n
    o = orientation(spec, cfg.swap_ab)  # the kernel's A tile is B's when swapped
    a_t, b_t = o.a_type, o.b_type
    per_stage = a_tile * _STORAGE_BYTES[a_t] + b_tile * _STORAGE_BYTES[b_t]
    ct = compute_type(spec.a_type, spec.b_type)
    converted = 0.0
    if a_t is not ct:
        converted += a_tile * _STORAGE_BYTES[ct]
    if b_t is not ct:
        converted += b_tile * _STORAGE_BYTES[ct]
    return int(per_stage * max(cfg.num_stages, 1) + converted)


def config_problem(spec: ProblemSpec, cfg: TileConfig, arch: ArchInfo) -> str | None:
    """Why ``cfg`` cannot run ``spec`` on ``arch``, or None when it is legal."""
    for name, hi in (("block_m", 256), ("block_n", 256), ("block_k", 512)):
        v = getattr(cfg, name)
        if not _pow2(v) or v < 16 or v > hi:
            return f"{name}={v}: expected a power of two in [16, {hi}]"
    ct = compute_type(spec.a_type, spec.b_type)
    eight_bit = ct in (OperandType.I8, OperandType.FP8, OperandType.BF8)
    if eight_bit and cfg.block_k < 32:
        return f"block_k={cfg.block_k}: 8-bit matrix instructions need block_k >= 32"
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={cfg.num_warps}: expected 1, 2, 4, 8 or 16"
    if not 1 <= cfg.num_stages <= 8:
        return f"num_stages={cfg.num_stages}: expected 1..8"
    if spec.scheme.grouped and spec.group_k % cfg.block_k:
        return f"block_k={cfg.block_k} must divide group_k={spec.group_k} (promotion per K-group)"
    if cfg.split_k < 1:
        return f"split_k={cfg.split_k}: expected >= 1"
    if cfg.split_k > 1 and spec.k and cfg.split_k > -(-spec.k // cfg.block_k):
        return f"split_k={cfg.split_k} exceeds the {-(-spec.k // cfg.block_k)} K tiles"
    smem = smem_estimate(spec, cfg)
    if smem > arch.smem_bytes:
        return f"shared memory {smem} B exceeds {arch.name}'s {arch.smem_bytes} B"
    return None
