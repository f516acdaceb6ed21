"""Reusable device buffers of split launches: fp32 workspaces for partial sums and zeroed tile
counters, one of each per (device, stream), grown as needed and never freed while a CUDA graph
captured with them may replay. Launches traced into a torch.compile graph (``direct.tracing``)
allocate fresh workspaces in the graph instead (inductor plans their memory) and take their tile
counters from the caller (``given_tile_counters``: a layer's)."""

from __future__ import annotations

import threading

import torch

from ..errors import UnsupportedError
from .direct import raw_stream, tracing


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _device_index(device: torch.device) -> int:
    """``device``'s index; the current device's for a bare ``torch.device("cuda")`` (whose index
    is None, which the raw stream query rejects)."""
    return torch.cuda.current_device() if device.index is None else device.index


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A reusable fp32 split-K workspace per (device, stream): a call allocates nothing but its
    output, and a workspace used inside a CUDA graph capture stays alive for its replays."""
    if device.type != "cuda" or tracing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    index = _device_index(device)
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws[:numel]


_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


class _Given(threading.local):
    counters: torch.Tensor | None = None


_GIVEN = _Given()


class given_tile_counters:  # noqa: N801 (used as a function: ``with given_tile_counters(c):``)
    """Within: split launches take their tile counters from ``counters`` (zeroed int32, owned by
    the caller: a ``QuantLinear``'s ``tile_counters``) where they fit (``counters_fit``), instead
    of the per-stream table. Traced into a compiled graph they are an input of the op that the
    kernel mutates (and puts back to zero), so the launch can be traced."""

    __slots__ = ("counters", "saved")

    def __init__(self, counters: torch.Tensor | None):
        self.counters = counters

    def __enter__(self):
        self.saved = _GIVEN.counters
        _GIVEN.counters = self.counters

    def __exit__(self, *exc):
        _GIVEN.counters = self.saved


def tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 tile counters for a kernel that sums its split-K partials itself (the
    kernels' FIXUP): the caller's (``given_tile_counters``) where they fit, else one table per
    (device, stream) like the workspaces. Such a kernel puts every counter it used back to zero,
    so they are zeroed once, when made. A grown table keeps the old one alive: a CUDA graph
    captured with it still points there.

    Traced into a compiled graph, only the caller's counters serve: fresh ones would need a
    zeroing kernel of the graph before every such launch (slower than the opaque op,
    bench/results/h100/inline/); without them the launch is not traced."""
    given = _GIVEN.counters
    if counters_fit(given, device, count):
        return given
    if tracing():  # (the launcher said it needs them: ``counters``; the caller did not look)
        raise UnsupportedError(f"tile counters: a traced split needs {count} of the caller's")
    if device.type != "cuda":
        return torch.zeros(count, dtype=torch.int32, device=device)
    index = _device_index(device)
    key = (index, raw_stream()(index))
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def counters_fit(counters: torch.Tensor | None, device: torch.device, count: int) -> bool:
    """Whether a caller's ``counters`` serve a split of ``count`` tiles on ``device``."""
    return counters is not None and counters.numel() >= count and counters.device == device


def split_buffers(device: torch.device, numel: int, direct: bool, counters: int = 0):
    """(workspace, counters) for a launch that writes fp32 partials: ``numel`` values of the
    current stream's workspace (the whole buffer on the direct path), and ``counters`` zeroed
    tile counters (``tile_counters``) for a kernel that sums its partials itself, else None."""
    ws = _stream_workspace(device, numel) if direct else _workspace(device, numel)
    return ws, (tile_counters(device, counters) if counters else None)


def _stream_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """``_workspace``'s buffer for ``device``'s current stream (same table, same key), whole."""
    if tracing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    index = _device_index(device)
    key = (index, raw_stream()(index))
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
        _WORKSPACES[key] = ws
    return ws
