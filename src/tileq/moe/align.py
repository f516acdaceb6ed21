"""Token sorting for the grouped GEMMs, on the device with static shapes (no ``nonzero``, ``.item()``
or ``.tolist()``; every tensor's size follows from T, k and E alone), so a CUDA graph can capture
it and replay it with other routing.

A token visits k experts: its k "slots" are numbered s = t * k + j (row t of topk_ids, column j).
Sorting the slots by expert (a stable sort: within an expert, slots stay in token order) gives

- contiguous form: grouped row r holds slot ``perm[r]``; expert e owns rows
  ``offsets[e]:offsets[e+1]`` (offsets int32 [E+1], from a binary search of the sorted ids);
- masked form: expert e's rows are ``x[e, 0:counts[e]]`` of an [E, C, K] buffer; grouped row r
  goes to flat row ``e * C + (r - offsets[e])``.

``slot_rows`` [T*k] is where each slot's output lands in the grouped output (flattened to rows),
so the combine is a gather and a sum over k: no atomics, the same order every run.

Contract (not checked: checking would synchronize): ids in [0, E); in the masked form no expert
gets more than C slots. C = T is exact when a token's k ids are distinct (torch.topk's are);
pass C = T * k for arbitrary ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DTypeError, ShapeError, expect


@dataclass
class Alignment:
    """Where every slot goes. ``tokens`` [S]: the token of each grouped row in sorted order (the
    gather index into hidden states); ``weights`` [S]: its routing weight (fp32, sorted order);
    ``offsets`` int32 [E+1]; ``counts`` int32 [E] (masked form, else None); ``dest`` [S]: the flat
    row of each sorted slot in the [E*C] buffer (masked form, else None); ``slot_rows`` [T*k]:
    each original slot's row in the grouped output; ``capacity``: C (masked) or 0."""

    tokens: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor | None
    dest: torch.Tensor | None
    slot_rows: torch.Tensor
    capacity: int


def check_topk(topk_ids, topk_weights, tokens: int) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ShapeError(expect("topk_ids", f"a 2-D tensor [T, k] with T={tokens} (hidden's rows)",
                                getattr(topk_ids, "shape", type(topk_ids).__name__)))
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise DTypeError(expect("topk_ids", "dtype int64 or int32", topk_ids.dtype))
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ShapeError(expect("topk_weights", f"shape {tuple(topk_ids.shape)} (topk_ids')",
                                getattr(topk_weights, "shape", type(topk_weights).__name__)))
    if not topk_weights.dtype.is_floating_point:
        raise DTypeError(expect("topk_weights", "a floating-point tensor", topk_weights.dtype))


def align(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *, form: str,
          capacity: int | None = None) -> Alignment:
    """Sort the slots of ``topk_ids`` [T, k] by expert for the grouped GEMM's ``form``
    ('contiguous' or 'masked'; ``capacity`` C defaults to T)."""
    t, k = topk_ids.shape
    s = t * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=dev, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
    tokens = torch.div(perm, k, rounding_mode="floor")
    weights = topk_weights.reshape(-1).float()[perm]
    # inverse permutation: rank[perm[r]] = r (each index written once: deterministic)
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(s, device=dev, dtype=perm.dtype)
    if form == "contiguous":
        return Alignment(tokens, weights, offsets, None, None, rank, 0)
    c = t if capacity is None else int(capacity)
    pos = torch.arange(s, device=dev, dtype=perm.dtype) - offsets.long()[sorted_ids.long()]
    dest = sorted_ids.long() * c + pos
    counts = (offsets[1:] - offsets[:-1]).contiguous()
    return Alignment(tokens, weights, offsets, counts, dest, dest[rank], c)
