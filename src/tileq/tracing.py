"""tileq's launches traced into a torch.compile graph (what ``ops``' inline twins run): whether a
call's launches can be traced, running it with them traced, and a layer's tile counters.

A launcher states, when it is made from its plan, whether torch's ``wrap_triton`` can carry its
launches (``untraced``: why not, e.g. a Gluon kernel's TMA descriptors hold data pointers, or a
launch option torch does not pass such as maxnreg) and the tile counters its split over K sums
with (``counters``). A traced launch takes those counters from its caller (a layer's: fresh ones
would need a zeroing kernel in the graph before every launch, slower than the opaque op:
bench/results/h100/inline/); without them the call is not traced.
"""

from __future__ import annotations

import torch

from .dispatch.plan import resolve_backend
from .kernels.buffers import counters_fit, given_tile_counters
from .kernels.direct import traced_launches

NO_COUNTERS = "tile counters: a split summed with tile counters the caller did not give"


def untraced(call, device: torch.device, tile_counters: torch.Tensor | None = None) -> str | None:
    """Why the launches of ``call`` (a prepared call: ``api.linear_call``'s, a quant-linear runner)
    on ``device`` cannot be traced, or None: its launchers' statement, then the tile counters its
    split needs, which the caller's ``tile_counters`` must hold."""
    why = call.untraced
    if why is None and call.counters and not counters_fit(tile_counters, device, call.counters):
        return NO_COUNTERS
    return why


def launches_nothing(x: torch.Tensor, backend: str | None = None) -> str | None:
    """"no launch" where a call on ``x`` launches no kernel (empty, or ``backend``'s executor the
    torch reference), else None."""
    return "no launch" if x.numel() == 0 or resolve_backend(backend, x.device)[0] == "reference" else None


def run_traced(fn, *args, tile_counters: torch.Tensor | None = None):
    """``fn(*args)`` with every launch traced into the graph being built (their launchers said they
    can be: ``untraced``), a split's tile counters taken from ``tile_counters``."""
    with traced_launches(), given_tile_counters(tile_counters):
        return fn(*args)


def layer_tile_counters(out_features: int, device) -> torch.Tensor:
    """A layer's own zeroed tile counters for its traced calls: one per output tile of its decode
    splits, whose tiles are at least 16 output features by 16 tokens (8 features per counter
    covers up to 32 tokens; a call whose split needs more stays the opaque op)."""
    return torch.zeros(max(64, -(-out_features // 8)), dtype=torch.int32, device=device)
