"""Which slice of a quantized layer a tensor-parallel rank holds, and how the slices join again.

Pure tensor arithmetic, no ``torch.distributed``: ``tp.py`` runs it on each rank, the tests run it
in one process.

Sharding follows transformers' tp_plan styles, whose weights are DTensors sharded like
``torch.chunk`` (rank r of W holds rows ``[r * c, min((r + 1) * c, L))`` with ``c = ceil(L / W)``):

* column-wise (``colwise``, ``colwise_rep``, ``colwise_gather_output``): the output features N.
  The weight's rows, a per-channel scale [N], the N axis of group scales ([Gk, N] for groups
  along K, [Gk, ceil(N / 128)] for 128 x 128 blocks) and the bias follow.
* ``packed_colwise`` (a merged gate/up weight): N is ``split_factor`` equal parts, each chunked
  as above; a rank holds its chunk of every part, concatenated.
* row-wise (``rowwise``, ``rowwise_rep``, ``rowwise_split_input``): the input features K. The
  weight's columns (pk_int4: its bytes, two K per byte) and the Gk axis of group scales follow; a
  per-channel scale [N] is the same on every rank (one scale per output row of the full K); the
  bias is added once, after the partial outputs are summed (``tp.py``).

A boundary must not cut a unit that one stored number describes: an int4 pair (2 along K), a K
group (``group_k``), a 128-row block of a block scale (``group_n``). Such a shard is refused with
a ``ShapeError`` naming the layer; the last chunk may end with a partial unit (the full layer's
own last unit is partial there too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ShapeError, UnsupportedError, expect
from ..nn.linear import QuantLinear

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")
PACKED_COLWISE = ("packed_colwise",)
STYLES = COLWISE + ROWWISE + PACKED_COLWISE


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``world`` under tp_plan style ``style``; ``split_factor`` only for
    ``packed_colwise`` (transformers' default, 2: gate and up)."""

    style: str
    rank: int
    world: int
    split_factor: int = 2

    def __post_init__(self):
        if self.style not in STYLES:
            raise UnsupportedError(expect("style", f"a tp_plan style tileq shards ({', '.join(STYLES)})",
                                          repr(self.style)))
        if not (0 <= self.rank < self.world):
            raise ShapeError(expect("rank", f"0 <= rank < world = {self.world}", self.rank))

    @property
    def axis(self) -> str:
        """'n' (output features) or 'k' (input features)."""
        return "k" if self.style in ROWWISE else "n"

    @property
    def parts(self) -> int:
        return self.split_factor if self.style in PACKED_COLWISE else 1


def chunk(length: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of rank ``rank``'s chunk of ``length`` (``torch.chunk`` / DTensor ``Shard``)."""
    c = math.ceil(length / world)
    lo = min(rank * c, length)
    return lo, min(lo + c, length)


def ranges(spec: ShardSpec, length: int, where: str) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of the sharded axis (of extent ``length``) that the rank holds."""
    p = spec.parts
    if length % p:
        raise ShapeError(f"{where}: {spec.style} splits {length} features into {p} equal parts; "
                         f"{length} is not a multiple of {p}")
    part = length // p
    out = []
    for i in range(p):
        lo, hi = chunk(part, spec.rank, spec.world)
        if lo == hi:
            raise ShapeError(f"{where}: {part} features over {spec.world} ranks leave rank {spec.rank} "
                             "no slice (more ranks than rows)")
        out.append((i * part + lo, i * part + hi))
    return out


def stored_range(lo: int, hi: int, length: int, unit: int, what: str, where: str) -> tuple[int, int]:
    """[lo, hi) of a logical axis in a stored axis where one entry covers ``unit`` logical ones
    (a packed byte, a K group, a block); refuses a boundary inside a unit."""
    if lo % unit or (hi % unit and hi != length):
        raise ShapeError(f"{where}: its tensor-parallel shard [{lo}, {hi}) of {length} cuts {what} "
                         f"(boundaries must be multiples of {unit}); use a tensor-parallel size that "
                         "keeps every rank's slice whole, or leave this layer unquantized")
    return lo // unit, math.ceil(hi / unit)


def _units(layer: QuantLinear, axis: str) -> list[tuple[str, int, str]]:
    """(tensor, unit, words) that a boundary on ``axis`` must respect."""
    c = layer.config
    out = []
    if axis == "k":
        if c.weight_dtype == "int4":
            out.append(("weight", 2, "an int4 pair (two K per byte)"))
        if c.weight_granularity == "group":
            out.append(("weight_scale", c.group_k, f"a K group of {c.group_k}"))
    elif c.weight_granularity == "group" and c.group_n > 1:
        out.append(("weight_scale", c.group_n, f"a {c.group_k}x{c.group_n} scale block"))
    return out


def refusal(layer: QuantLinear, spec: ShardSpec, where: str) -> str | None:
    """Why ``layer`` cannot be sharded under ``spec`` (None when it can): checked from shapes alone,
    so every rank decides the same before any collective."""
    try:
        _plan(layer, spec, where)
    except ShapeError as e:
        return str(e)
    return None


def _plan(layer: QuantLinear, spec: ShardSpec, where: str) -> list[tuple[int, int]]:
    length = layer.in_features if spec.axis == "k" else layer.out_features
    rs = ranges(spec, length, where)
    for lo, hi in rs:
        for _, unit, what in _units(layer, spec.axis):
            stored_range(lo, hi, length, unit, what, where)
    return rs


def shard_tensors(layer: QuantLinear, spec: ShardSpec, where: str) -> dict:
    """The rank's tensors of ``layer`` (weight in its interchange form: pk_int4 for int4):
    ``weight``, ``weight_scale``, ``bias`` (None for row-wise), ``tp_bias`` (row-wise: the full
    bias, added after the reduction; else None), ``input_scale``, ``in_features``."""
    rs = _plan(layer, spec, where)
    c = layer.config
    w, s, b = layer.packed_weight(), layer.weight_scale, layer.bias
    n, k = layer.out_features, layer.in_features
    if spec.axis == "k":
        (lo, hi), = rs
        wu = 2 if c.weight_dtype == "int4" else 1
        a, z = stored_range(lo, hi, k, wu, "an int4 pair", where)
        weight = w[:, a:z]
        if c.weight_granularity == "group":
            a, z = stored_range(lo, hi, k, c.group_k, "a K group", where)
            scale = s[a:z]
        else:
            scale = s
        bias, tp_bias, k_local = None, b, hi - lo
    else:
        weight = torch.cat([w[lo:hi] for lo, hi in rs])
        if c.weight_granularity == "group":
            gn = c.group_n
            scale = torch.cat([s[:, slice(*stored_range(lo, hi, n, gn, "a scale block", where))] for lo, hi in rs], 1)
        else:
            scale = torch.cat([s[lo:hi] for lo, hi in rs])
        bias = None if b is None else torch.cat([b[lo:hi] for lo, hi in rs])
        tp_bias, k_local = None, k
    copy = (lambda t: None if t is None else t.contiguous().clone())
    return {"weight": copy(weight), "weight_scale": copy(scale), "bias": copy(bias), "tp_bias": copy(tp_bias),
            "input_scale": copy(layer.input_scale), "in_features": k_local}


def shard_quant_linear(layer: QuantLinear, spec: ShardSpec, where: str | None = None) -> QuantLinear:
    """The rank's QuantLinear of ``layer`` (a new layer; ``layer`` is not modified). A row-wise
    shard holds no bias: its full bias is the returned layer's ``tp_bias`` (a buffer outside the
    state dict), which ``tp.py`` adds once after the reduction."""
    where = where or layer.qualified_name or "layer"
    t = shard_tensors(layer, spec, where)
    return _build(layer, t)


def _build(like: QuantLinear, t: dict) -> QuantLinear:
    out = QuantLinear.from_quantized(t["weight"], t["weight_scale"], config=like.config, bias=t["bias"],
                                     input_scale=t["input_scale"], in_features=t["in_features"], dtype=like.dtype)
    out.register_buffer("tp_bias", t["tp_bias"], persistent=False)
    out.qualified_name = like.qualified_name
    return out


def unshard_tensors(parts: list[dict], spec: ShardSpec, config, out_features: int, in_features: int) -> dict:
    """The inverse of ``shard_tensors``: the full layer's tensors from every rank's (rank order)."""
    if spec.axis == "k":
        weight = torch.cat([p["weight"] for p in parts], 1)
        if config.weight_granularity == "group":
            scale = torch.cat([p["weight_scale"] for p in parts], 0)
        else:
            scale = parts[0]["weight_scale"]
        bias = parts[0]["tp_bias"]
    else:
        by_part = [[] for _ in range(spec.parts)]
        for r, p in enumerate(parts):
            rs = ranges(ShardSpec(spec.style, r, spec.world, spec.split_factor), out_features, "layer")
            sizes = [hi - lo for lo, hi in rs]
            w = p["weight"].split(sizes, 0)
            if config.weight_granularity == "group":
                s = p["weight_scale"].split([math.ceil(z / config.group_n) for z in sizes], 1)
            else:
                s = p["weight_scale"].split(sizes, 0)
            b = p["bias"].split(sizes) if p["bias"] is not None else [None] * len(sizes)
            for i in range(spec.parts):
                by_part[i].append((w[i], s[i], b[i]))
        rows = [x for part in by_part for x in part]  # part-major: the full layer's row order
        weight = torch.cat([w for w, _, _ in rows], 0)
        scale = torch.cat([s for _, s, _ in rows], 1 if config.weight_granularity == "group" else 0)
        bias = None if rows[0][2] is None else torch.cat([b for _, _, b in rows])
    return {"weight": weight.contiguous(), "weight_scale": scale.contiguous(), "bias": bias,
            "input_scale": parts[0]["input_scale"], "in_features": in_features}


def unshard_quant_linear(parts: list[QuantLinear], spec: ShardSpec, out_features: int, in_features: int
                         ) -> QuantLinear:
    """The full QuantLinear from every rank's shard (rank order), exactly the layer that was sharded."""
    tensors = [local_tensors(p) for p in parts]
    t = unshard_tensors(tensors, spec, parts[0].config, out_features, in_features)
    full = QuantLinear.from_quantized(t["weight"], t["weight_scale"], config=parts[0].config, bias=t["bias"],
                                      input_scale=t["input_scale"], in_features=in_features, dtype=parts[0].dtype)
    full.qualified_name = parts[0].qualified_name
    return full


def local_tensors(layer: QuantLinear) -> dict:
    """A shard's tensors in the form ``unshard_tensors`` takes."""
    return {"weight": layer.packed_weight(), "weight_scale": layer.weight_scale, "bias": layer.bias,
            "tp_bias": getattr(layer, "tp_bias", None), "input_scale": layer.input_scale}
