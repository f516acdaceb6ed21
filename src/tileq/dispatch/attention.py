"""Decode attention's launch shape (``kernels/decode_attention.py``): the key block per loop step,
the pipeline and how many key ranges each (batch, kv head) is split into.

A decode attention program streams K and V and does little arithmetic on them: the kernel is
memory bound, and its speed is how many programs stream at once. (batch x kv heads) programs fill
few SMs (8 of an H100's 132 for one Qwen3-14B sequence), so each row of the cache is cut into
ranges until the grid fills every program slot the SMs have (``waves.split_for_programs``): the
SM count times how many programs fit on an SM by shared memory (3 on sm_90 for the usual tiles:
the SMs filled three times over). Every range keeps at least one key block, and there are never
more ranges than blocks. Nothing here is fitted: the block size and the residency are design
rules derived from the kernel's tiles and the device's facts (``tileq.device.facts``). Timed only
in a model so far (bench/results/h100/decode-attention/); other block sizes and splits have not
been compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import device as _device
from ..kernels.decode_attention import group_tile
from .waves import cdiv, split_for_programs

# One K (or V) block per loop step: 16 KB, e.g. 64 keys of D = 128 in bf16 (eight 16-byte loads
# per thread of 4 warps for each of K and V). Deeper blocks would leave short caches (a few hundred
# keys) too few ranges to fill the SMs; shallower ones issue fewer bytes per step.
KV_BLOCK_BYTES = 16384
# Triton's software pipeline: with 3 stages it keeps two buffers each of K and V in shared memory,
# loading the next blocks (cp.async) while the current ones are used.
NUM_STAGES = 3
# The fp32 accumulator [BLOCK_G, D] is at most [32, 256] (``kernels.decode_attention.MAX_GROUP``):
# 64 values per thread of 4 warps, beside the scores and the query tile.
NUM_WARPS = 4


@dataclass(frozen=True)
class DecodeAttentionConfig:
    block_n: int  # key positions per loop step
    splits: int  # key ranges per (batch, kv head)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the residency the split was sized for

    def describe(self) -> str:
        return (f"{self.splits} key range(s) of {self.block_n}-key blocks, {self.num_warps} warps, "
                f"{self.num_stages} stages (sized for {self.programs_per_sm} programs per SM)")


def shared_bytes(block_n: int, head_dim: int, elem_bytes: int, block_g: int, num_stages: int = NUM_STAGES) -> int:
    """The split kernel's shared memory as Triton lays it out for sm_90 (its build is checked against
    this, tests/test_decode_attention.py): num_stages - 1 buffers each of K and V, the query tile and
    the probabilities' tile (P @ V's operand)."""
    return (2 * (num_stages - 1) * block_n * head_dim + block_g * head_dim + block_g * block_n) * elem_bytes


def decode_attention_config(batch: int, kv_heads: int, group: int, length: int, head_dim: int, dtype,
                            device, *, interpreted: bool = False, splits: int | None = None) -> DecodeAttentionConfig:
    """The launch of one decode attention call: ``batch`` x ``kv_heads`` rows of ``length`` keys of
    ``head_dim`` values, ``group`` query heads per kv head. ``splits`` forces the number of ranges
    (tests and experiments); None sizes it to fill the device."""
    elem = dtype.itemsize
    block_n = KV_BLOCK_BYTES // (head_dim * elem)
    facts = _device.facts(device if not interpreted else torch.device("cpu"))
    per_sm = max(1, facts.smem_bytes // shared_bytes(block_n, head_dim, elem, group_tile(group)))
    if splits is None:
        blocks = cdiv(length, block_n)
        splits = split_for_programs(batch * kv_heads, facts.num_sms * per_sm, blocks, 1, max(blocks, 1))
    return DecodeAttentionConfig(block_n, splits, NUM_WARPS, NUM_STAGES, per_sm)
