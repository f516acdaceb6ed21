"""The prepacked int4 weight layout ``i4p1``, byte by byte.

The logical weight is W [N, K] (nn.Linear orientation, K the reduction), values v in [-8, 7],
stored as nibbles v + 8 (pk_int4's encoding). K is padded up to a multiple of ``BLOCK_K`` = 512
with v = 0 (nibble 8); the padding is part of the format and ``unprepack_int4`` checks it.

Storage: ``data`` is int32 [N, Kp / 8], rows contiguous, words little-endian. Row n, K block b
(k in [512 b, 512 b + 512)) owns the 64 words ``data[n, 64 b : 64 b + 64]``. Word c of a block
holds eight nibbles, nibble s at bits 4 s .. 4 s + 3:

    even c:  nibble q     (q = 0..3) holds k = 512 b + 64 q + c
             nibble 4 + q            holds k = 512 b + 64 q + c + 1
    odd c:   nibble q                holds k = 512 b + 256 + 64 q + (c - 1)
             nibble 4 + q            holds k = 512 b + 256 + 64 q + (c - 1) + 1

Why: the kernel splits each 512-wide K tile into eight 64-wide slices, one per wgmma chain. A
thread of the warpgroup holds, for its rows, the consecutive pairs (k, k + 1) of a slice in one
32-bit register (the wgmma A fragment). The words (c, c + 1) that a thread loads together carry
those pairs for all eight slices, each pair 16 bits apart at the same nibble position, so one
LOP3 ``(w >> 4 q) & 0x000F000F | 0x43004300`` makes two bf16 values 128 + nibble (fp16: magic
0x6400, 1024 + nibble) and one packed subtraction leaves v exactly. No byte-wise shared loads,
no interleaving shuffles: 3 shifts, 4 LOP3 and 4 packed subtractions per 8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import PackedInt4
from .errors import DTypeError, ShapeError, expect

LAYOUT = "i4p1"
BLOCK_K = 512
WORDS_PER_BLOCK = BLOCK_K // 8


def _slot_k() -> torch.Tensor:
    """[64, 8] int64: the k (within a 512 block) of nibble s of word c."""
    c = torch.arange(WORDS_PER_BLOCK).view(-1, 1)
    s = torch.arange(8).view(1, -1)
    q = s % 4
    return 256 * (c % 2) + 64 * q + 2 * (c // 2) + s // 4


_SLOT_K = _slot_k()


def padded_k(k: int) -> int:
    return -(-k // BLOCK_K) * BLOCK_K


@dataclass(frozen=True)
class PrepackedInt4:
    """An int4 nn.Linear weight [N, K] in the ``i4p1`` layout (see the module docstring).

    ``data`` int32 [N, ceil(K / 512) * 64] with contiguous rows; ``shape`` the logical (N, K).
    """

    data: torch.Tensor
    shape: tuple[int, int]
    layout: str = LAYOUT

    def __post_init__(self) -> None:
        d = self.data
        if not isinstance(d, torch.Tensor):
            raise DTypeError(expect("PrepackedInt4.data", "a torch.Tensor", type(d).__name__))
        if d.dtype != torch.int32:
            raise DTypeError(expect("PrepackedInt4.data", "dtype torch.int32", d.dtype))
        if self.layout != LAYOUT:
            raise DTypeError(expect("PrepackedInt4.layout", repr(LAYOUT), repr(self.layout)))
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != 2 or min(shape) < 0:
            raise ShapeError(expect("PrepackedInt4.shape", "two non-negative extents (N, K)", self.shape))
        object.__setattr__(self, "shape", shape)
        want = (shape[0], padded_k(shape[1]) // 8)
        if d.dim() != 2 or tuple(d.shape) != want:
            raise ShapeError(expect("PrepackedInt4.data", f"shape {want} for the logical {shape}",
                                    tuple(d.shape)))
        if d.shape[1] > 1 and d.stride(1) != 1 or d.shape[0] > 1 and d.stride(0) != d.shape[1]:
            raise ShapeError(expect("PrepackedInt4.data", "contiguous rows", f"strides {d.stride()}"))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def k_padded(self) -> int:
        return self.data.shape[1] * 8

    def to(self, device) -> "PrepackedInt4":
        return PrepackedInt4(self.data.to(device), self.shape)


def _values(w) -> torch.Tensor:
    """int8 [N, K] values of an nn.Linear-oriented PackedInt4 (packed along K) or an int tensor."""
    from .quant import unpack_int4

    if isinstance(w, PackedInt4):
        if w.packed_dim != 1:
            raise ShapeError(expect("weight", "a PackedInt4 [N, K] packed along K (packed_dim=1)",
                                    f"packed_dim={w.packed_dim}"))
        return unpack_int4(w)
    if isinstance(w, torch.Tensor) and not w.dtype.is_floating_point and w.dim() == 2:
        if w.numel() and (int(w.min()) < -8 or int(w.max()) > 7):
            raise DTypeError(expect("weight", "int4 values in [-8, 7]",
                                    f"values in [{int(w.min())}, {int(w.max())}]"))
        return w.to(torch.int8)
    raise DTypeError(expect("weight", "a tileq.PackedInt4 [N, K] or a 2-D integer tensor of int4 values",
                            type(w).__name__ if not isinstance(w, torch.Tensor) else f"{w.dtype} {w.dim()}-D"))


def prepack_int4(w) -> PrepackedInt4:
    """An nn.Linear int4 weight (PackedInt4 [N, K] packed along K, or int values) in layout i4p1.

    Offline (torch operations on the weight's device, no kernel): run once when a model loads.
    Works in uint8 nibbles and int32 halves: about 4 bytes of temporaries per weight."""
    v = _values(w)
    n, k = v.shape
    kp = padded_k(k)
    nib = torch.full((n, kp), 8, dtype=torch.uint8, device=v.device)
    nib[:, :k] = (v + 8).to(torch.uint8)
    slots = nib.view(n, kp // BLOCK_K, BLOCK_K)[:, :, _SLOT_K.to(v.device)]  # [N, B, 64, 8] uint8
    del nib
    # Nibbles 0-3 make the low 16 bits, 4-7 the high 16 bits: each half fits an int32 exactly.
    lo = torch.zeros(slots.shape[:-1], dtype=torch.int32, device=v.device)
    hi = torch.zeros_like(lo)
    for s in range(4):
        lo |= slots[..., s].to(torch.int32) << (4 * s)
        hi |= slots[..., 4 + s].to(torch.int32) << (4 * s)
    del slots
    # (hi << 16) | lo as a signed 32-bit word: hi >= 0x8000 sets the sign bit.
    words = (hi - ((hi >> 15) << 16)) << 16 | lo
    return PrepackedInt4(words.reshape(n, kp // 8).contiguous(), (n, k))


def prepacked_values(p: PrepackedInt4) -> torch.Tensor:
    """int8 [N, Kp] values (padding included) of a PrepackedInt4."""
    n = p.shape[0]
    kp = p.k_padded
    words = p.data.view(n, kp // BLOCK_K, WORDS_PER_BLOCK)
    out = torch.empty((n, kp // BLOCK_K, BLOCK_K), dtype=torch.int8, device=words.device)
    slot_k = _SLOT_K.to(words.device)
    for s in range(8):
        # An arithmetic shift of the signed word still leaves the nibble in the low 4 bits.
        out[:, :, slot_k[:, s]] = (((words >> (4 * s)) & 15) - 8).to(torch.int8)
    return out.view(n, kp)


def unprepack_int4(p: PrepackedInt4) -> PackedInt4:
    """The exact inverse of ``prepack_int4``: the PackedInt4 [N, K] (packed along K)."""
    from .quant import pack_int4

    if not isinstance(p, PrepackedInt4):
        raise DTypeError(expect("p", "a tileq.PrepackedInt4", type(p).__name__))
    v = prepacked_values(p)
    k = p.shape[1]
    if bool((v[:, k:] != 0).any()):
        raise ShapeError(expect("PrepackedInt4.data", f"zero padding beyond K = {k}",
                                "non-zero values in the padding (not made by prepack_int4?)"))
    return pack_int4(v[:, :k].contiguous(), dim=1)
