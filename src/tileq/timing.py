"""GPU timing shared by ``tileq tune`` and the benchmark harness.

CUDA events around each run, the L2 flushed before each run by writing a buffer twice its size
(H200: 60 MB of L2), many runs after a warm-up, medians reported (DESIGN.md section 7).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


_FLUSH: dict[int, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 64 << 20) or (64 << 20)
        _FLUSH[idx] = torch.empty(2 * l2, dtype=torch.int8, device=torch.device("cuda", idx))
    return _FLUSH[idx]


def time_cuda(fn, *, warmup: int = 50, reps: int = 100, flush: bool = True,
              device: torch.device | None = None) -> Timing:
    """Median/min/max milliseconds of ``fn()`` measured with CUDA events, one pair per run."""
    device = device or torch.device("cuda")
    buf = _flush_buffer(device) if flush else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if buf is not None:
            buf.zero_()  # evict the operands: every run reads them from HBM
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), min(times), max(times), reps)
