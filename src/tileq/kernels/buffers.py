"""Reusable device buffers of split launches: fp32 workspaces for partial sums and zeroed tile
counters, one of each per (device, stream), grown as needed and never freed while a CUDA graph
captured with them may replay. Launches traced into a torch.compile graph (``direct.tracing``)
allocate fresh ones in the graph instead: inductor plans their memory."""

from __future__ import annotations

import torch

from .direct import raw_stream, tracing, untraceable


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


def tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 tile counters for a kernel that sums its split-K partials itself (the int4
    kernels' FIXUP), per (device, stream) like the workspaces: such a kernel puts
    every counter it used back to zero, so they are zeroed once, when made. A grown table keeps
    the old one alive: a CUDA graph captured with it still points there.

    A launch that needs them is not traced into a compiled graph (``direct.tracing``): the graph
    would zero fresh counters with a kernel of its own before every such launch, which cost more
    host time than the opaque op saved (an 8-layer FP8Block decode step compiled without a CUDA
    graph: 3.85 ms traced against 3.41 ms opaque, H100, bench/results/h100/inline/)."""
    if tracing():
        untraceable("tile counters")
        return torch.zeros(count, dtype=torch.int32, device=device)
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
