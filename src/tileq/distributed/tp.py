"""tileq layers inside a model sharded by transformers' tensor parallelism (``tp_plan``).

transformers (5.17 through 5.25, ``integrations/compat.py``) shards a model by its ``tp_plan`` (``{"model.layers.*.mlp.down_proj":
"rowwise", ...}``): each nn.Linear's weight becomes a DTensor holding the rank's slice, and its
``forward`` is wrapped (on the instance) by the style's input / output transforms, e.g. the
all-reduce of a row-wise layer's partial output. Replacing such a Linear by a ``QuantLinear``
would drop both; here the replacement gets them back:

* ``quantize_linear``: the full weight is gathered (``DTensor.full_tensor``, one layer at a
  time), quantized exactly as a single process quantizes it, and the rank keeps its slice
  (``shard.py``): quantize-then-shard and shard-then-quantize give the same tensors bit for bit.
* ``install``: the style's transforms from transformers' own registry (``ALL_PARALLEL_STYLES``)
  are installed on the QuantLinear, flagged ``_hf_quantized_needs_local_tp`` (transformers' flag
  for quantized layers that take local tensors). Column-wise layers pass local tensors through
  (``colwise_gather_output`` all-gathers as transformers does). Row-wise layers use
  ``QuantRowwiseParallel``: transformers' ``RowwiseParallel`` whose output step is the one it
  runs for its own nn.Linear at inference (``dist.all_reduce`` of the partial output, then the
  bias once), since a QuantLinear's bias is a buffer that transformers' step would not see.
* ``gather_layer``: the full layer again, on rank 0 (``save_pretrained``).

The single-process path is untouched: nothing here runs unless a model has a device mesh and
DTensor weights, and a sharded layer's extra work is its instance ``forward`` wrapper.

Activations are quantized per rank: a row-wise layer quantizes its own K slice, so its per-token
scales differ from one process's (docs/tensor-parallel.md says why the result agrees within one
quantization step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import TileqError, UnsupportedError, expect
from ..integrations import compat
from ..nn.linear import QuantLinear
from .shard import (
    COLWISE,
    PACKED_COLWISE,
    ROWWISE,
    STYLES,
    ShardSpec,
    refusal,
    shard_quant_linear,
    unshard_quant_linear,
)


@dataclass
class TPInfo:
    """What a sharded QuantLinear knows of its place: its shard, the mesh, the full layer's size."""

    spec: ShardSpec
    mesh: object
    out_features: int
    in_features: int

    def __deepcopy__(self, memo):  # the mesh is a process-wide object: copies share it
        return TPInfo(self.spec, self.mesh, self.out_features, self.in_features)


def style_for(tp_plan: dict, name: str) -> str | None:
    """The tp_plan style of module ``name`` (transformers' rule: layer numbers become ``*``)."""
    generic = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    return tp_plan.get(generic)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def tp_mesh(model: nn.Module):
    """The tensor-parallel mesh of a transformers model loaded with a tp_plan, or None."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    if mesh.ndim > 1:
        mesh = mesh["tp"]
    return mesh if mesh.size() > 1 else None


class TensorParallel:
    """A sharded model's mesh and plan; ``of(model)`` is None for a model that is not sharded."""

    def __init__(self, mesh, tp_plan: dict):
        compat.require_supported("tensor parallelism")
        self.mesh, self.tp_plan = mesh, dict(tp_plan or {})
        self.rank, self.world = mesh.get_local_rank(), mesh.size()

    @classmethod
    def of(cls, model: nn.Module) -> TensorParallel | None:
        mesh = tp_mesh(model)
        if mesh is None:
            if any(_is_dtensor(p) for p in model.parameters()):
                raise UnsupportedError(expect("model", "a model sharded by transformers' tp_plan (with a "
                                                       "device mesh) or an unsharded one",
                                              "DTensor parameters without model._device_mesh"))
            return None
        return cls(mesh, getattr(model, "tp_plan", None) or {})

    def style(self, name: str) -> str | None:
        """The tp_plan style of module ``name`` if tileq shards it, None if the plan leaves it whole;
        an UnsupportedError for a style tileq has no rule for."""
        style = style_for(self.tp_plan, name)
        if style is not None and style not in STYLES:
            raise UnsupportedError(expect(f"{name}: tp_plan style", f"one of {', '.join(STYLES)} for a quantized "
                                                                   "layer", repr(style)))
        return style

    def spec(self, style: str) -> ShardSpec:
        return ShardSpec(style, self.rank, self.world)

    # ------------------------------------------------------------------ quantize_

    def quantize_linear(self, name: str, linear: nn.Linear, config, hessian=None) -> tuple[QuantLinear | None, str]:
        """(the rank's QuantLinear with its tp hooks, "") or (None, why ``linear`` stays as it is).
        Every rank decides from shapes and the plan alone (the same answer everywhere) before the
        collective that gathers the weight."""
        from ..nn.linear import quantize_linear_or_reason

        w = linear.weight
        if not _is_dtensor(w):
            return quantize_linear_or_reason(linear, config, hessian)
        style = style_for(self.tp_plan, name)
        if style not in STYLES:
            return None, (f"tensor-parallel style {style!r} (tileq shards {', '.join(STYLES)})" if style
                          else "a DTensor weight that the model's tp_plan does not name")
        why = config.cannot_serve(linear.in_features, linear.out_features)
        if why is not None:
            return None, why
        probe = QuantLinear(linear.in_features, linear.out_features, linear.bias is not None, config=config,
                            device="meta")
        why = refusal(probe, self.spec(style), name)
        if why is not None:
            return None, why
        full = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        full.weight = nn.Parameter(w.full_tensor().detach(), requires_grad=False)
        if linear.bias is not None:
            b = linear.bias
            full.bias = nn.Parameter((b.full_tensor() if _is_dtensor(b) else b).detach(), requires_grad=False)
        try:
            layer, why = quantize_linear_or_reason(full, config, hessian)
        finally:
            del full
        if layer is None:
            return None, why
        layer.qualified_name = name
        local = shard_quant_linear(layer, self.spec(style), name)
        self.install(local, style, linear.in_features, linear.out_features)
        return local, ""

    # ------------------------------------------------------------------ hooks

    def install(self, layer: QuantLinear, style: str, in_features: int, out_features: int) -> QuantLinear:
        """Give ``layer`` (a rank's shard) the forward transforms of tp_plan style ``style``."""
        layer.tp_info = TPInfo(self.spec(style), self.mesh, out_features, in_features)
        layer._hf_quantized_needs_local_tp = True
        style_obj = _style(style)
        style_obj.install_forward(layer, self.mesh)
        if style in ROWWISE:  # for callers that run the GEMM without the module (the fused decoder)
            mesh = self.mesh
            layer.tp_reduce = lambda y: style_obj.transform_output_post_forward(layer, y, mesh)
        return layer


def _style(name: str):
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        RowwiseParallel,
    )

    style = ALL_PARALLEL_STYLES[name]
    if name in ROWWISE:
        assert isinstance(style, RowwiseParallel)
        return QuantRowwiseParallel.like(style)
    if name not in COLWISE + PACKED_COLWISE:
        raise UnsupportedError(expect("style", f"one of {', '.join(STYLES)}", repr(name)))
    return style


def _rowwise_base():
    from transformers.distributed.tensor_parallel import RowwiseParallel

    return RowwiseParallel


class QuantRowwiseParallel(_rowwise_base()):
    """transformers' ``RowwiseParallel`` for a QuantLinear shard: the partial outputs are summed by
    ``dist.all_reduce`` over the mesh (what transformers runs for its own nn.Linear at inference)
    and the full bias (``tp_bias``, fp32) is added once, after the sum."""

    @classmethod
    def like(cls, style) -> QuantRowwiseParallel:
        from torch.distributed.tensor import Replicate

        if style.output_layouts != Replicate():
            raise UnsupportedError(expect("rowwise output layout", "Replicate (an all-reduce)",
                                          f"{style.output_layouts} (a reduce-scatter: sequence parallelism)"))
        return cls(input_layouts=style.input_layouts, output_layouts=style.output_layouts,
                   use_local_output=style.use_local_output)

    def transform_output_post_forward(self, module, output, mesh, *args, **kwargs):
        # transformers 5.25 passes the model's config too (integrations/compat.py); the sum needs none of it
        import torch.distributed as dist

        dist.all_reduce(output, group=mesh.get_group())
        bias = module.tp_bias
        if bias is not None:
            output = (output + bias).to(output.dtype)
        return output


# ----------------------------------------------------------------------------- saving


def gather_layer(layer: QuantLinear, first: bool) -> QuantLinear | None:
    """The full layer (host memory) on the mesh's rank 0 (``first``), None on the other ranks; a
    collective. A layer without ``tp_info`` (not sharded) is returned as it is on rank 0."""
    info = getattr(layer, "tp_info", None)
    if info is None:
        return layer if first else None
    from .shard import local_tensors

    group, world = info.mesh.get_group(), info.spec.world
    mine = local_tensors(layer)
    got = [{} for _ in range(world)]
    for key, t in mine.items():  # None-ness is the same on every rank (same config, same style)
        pieces = _all_gather(t, group, world) if t is not None else [None] * world
        for r in range(world):
            got[r][key] = pieces[r]
    if info.mesh.get_local_rank() != 0:
        return None
    shells = []
    for t in got:
        shell = QuantLinear.from_quantized(t["weight"], t["weight_scale"], config=layer.config, bias=t["bias"],
                                           input_scale=t["input_scale"],
                                           in_features=_local_in(t["weight"], layer.config), dtype=layer.dtype)
        shell.register_buffer("tp_bias", t["tp_bias"], persistent=False)
        shells.append(shell)
    full = unshard_quant_linear(shells, info.spec, info.out_features, info.in_features)
    full.qualified_name = layer.qualified_name
    return full


def _all_gather(t: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    """Every rank's ``t`` (shapes may differ: the last chunk can be shorter), on the host. Sent as
    raw bytes padded to the largest shape, so any dtype (fp8 included) travels on any backend."""
    import torch.distributed as dist

    shapes: list = [None] * world
    dist.all_gather_object(shapes, tuple(t.shape), group=group)
    big = tuple(max(s[d] for s in shapes) for d in range(t.dim()))
    raw = t.contiguous().view(torch.uint8) if t.dim() and t.dtype.itemsize == 1 else t
    pad = raw.new_zeros(big)
    pad[tuple(slice(0, n) for n in t.shape)] = raw
    outs = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(outs, pad, group=group)
    return [o[tuple(slice(0, n) for n in s)].contiguous().view(t.dtype).cpu() for o, s in zip(outs, shapes)]


def _local_in(weight: torch.Tensor, config) -> int:
    return weight.shape[1] * (2 if config.weight_dtype == "int4" else 1)


def gather_for_save(tp: TensorParallel, model: nn.Module, layers: dict, merged: set, plain_state):
    """(full QuantLinears by name, [(name, full tensor)] of everything else) on the mesh's rank 0,
    (None, None) on the others; every rank must call it (collectives, in the same order)."""
    first = tp.rank == 0
    full = {}
    for name, layer in layers.items():
        f = gather_layer(layer, first)
        if f is not None:
            full[name] = f
    plain = []
    for name, t in plain_state(model, set(layers) | merged):
        t = t.full_tensor() if _is_dtensor(t) else t
        if first:
            plain.append((name, t.detach().cpu()))
    return (full, plain) if first else (None, None)


def after_save(tp: TensorParallel, fmt: str | None) -> str:
    """Rank 0's answer (the format it wrote) on every rank, once its files are written."""
    import torch.distributed as dist

    box = [fmt]
    dist.broadcast_object_list(box, group_src=0, group=tp.mesh.get_group())
    return box[0]


def refuse_calibration() -> TileqError:
    return UnsupportedError(expect("calibration", "None on a tensor-parallel model (GPTQ's Hessians are "
                                                  "collected on the unsharded model: quantize it first, "
                                                  "save it, then load it with tp_plan)", "a callable"))
