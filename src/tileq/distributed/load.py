"""Loading a rank's slice of a quantized checkpoint (``tileq.from_pretrained(path, tp_plan=...)``).

The model skeleton is sharded by transformers itself (``DistributedConfig`` ->
``prepare_distribute_model`` / ``maybe_distribute_model``: the device mesh, DTensor placeholders,
the styles' forward transforms). Each quantized layer the tp_plan shards is then read through a
``ShardedReader``: a view of the checkpoint in which the layer's stored tensors have the rank's
shape, read with safetensors' ``get_slice`` (no rank reads a full tensor of a sharded layer). The
format's own loader reads that view as the checkpoint of a smaller layer, so every check and
layout conversion it makes applies unchanged, and the result is exactly ``shard.py``'s slice of
the layer a single process loads.

Which axis of each stored tensor follows N or K, and in units of how many features, is listed per
format below (``_AXES``); anything not listed is refused rather than guessed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ShapeError, UnsupportedError, expect
from ..formats import compressed_tensors as ct
from ..formats import deepseek_fp8 as dsf
from ..formats import tileq_format as tqf
from ..formats.layer import load_layer
from ..formats.safetensors_io import CheckpointReader, TensorInfo
from ..nn.linear import QuantLinear
from .shard import ShardSpec, chunk, ranges, refusal, stored_range
from .tp import TensorParallel


def _axes(method: str, local: str, config, plan) -> dict:
    """{'n' | 'k': (dim, unit)} of a stored tensor ``local`` of a layer; an axis not in the result
    is not stored along (the tensor is the same on every rank along it). None: not understood."""
    if method == tqf.QUANT_METHOD:
        if local == "weight":
            return {"n": (0, 1), "k": (1, 2 if config.weight_dtype == "int4" else 1)}
        if local == "weight_scale":
            if config.weight_granularity == "col":
                return {"n": (0, 1)}
            return {"k": (0, config.group_k), "n": (1, config.group_n)}
    elif method == dsf.QUANT_METHOD:
        if local == "weight":
            return {"n": (0, 1), "k": (1, 1)}
        if local == "weight_scale_inv":
            return {"n": (0, 128), "k": (1, 128)}
    elif method == ct.QUANT_METHOD:
        w = plan.scheme.weights
        if local == "weight":
            return {"n": (0, 1), "k": (1, 1)}
        if local == "weight_packed":
            return {"n": (0, 1), "k": (1, 32 // w.num_bits)}
        if local == "weight_scale":
            if w.strategy == "tensor":
                return {}
            if w.strategy == "channel":
                return {"n": (0, 1)}
            if w.strategy == "group":
                return {"n": (0, 1), "k": (1, w.group_size)}
            bh, bw = w.block_structure
            return {"n": (0, bh), "k": (1, bw)}
    if local == "bias":
        return {"n": (0, 1)}
    if local == "input_scale":
        return {}
    return None


class ShardedReader:
    """A ``CheckpointReader`` in which some layers' tensors are the rank's slices: ``info`` gives
    the slice's shape, ``read`` reads only the slice. Everything else is the checkpoint's."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self._index: dict[str, tuple] = {}  # name -> per-dim list of [start, stop) ranges
        self._replace: dict[str, torch.Tensor] = {}  # name -> a small tensor read as given

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def keys(self):
        return self.reader.keys()

    def children(self, prefix: str):
        return self.reader.children(prefix)

    def metadata(self, f=None):
        return self.reader.metadata(f)

    @property
    def on_read(self):
        return self.reader.on_read

    def read_slices(self, name: str, per_dim) -> torch.Tensor:
        return self.reader.read_slices(name, per_dim)

    def info(self, name: str) -> TensorInfo:
        i = self.reader.info(name)
        if name in self._replace:
            t = self._replace[name]
            return TensorInfo(name, t.dtype, str(t.dtype), tuple(t.shape), i.file)
        idx = self._index.get(name)
        if idx is None:
            return i
        shape = tuple(sum(z - a for a, z in rs) if rs is not None else s for rs, s in zip(idx, i.shape))
        return TensorInfo(name, i.dtype if isinstance(i.dtype, torch.dtype) else None, str(i.dtype), shape, i.file)

    def read(self, name: str, device=None) -> torch.Tensor:
        if name in self._replace:
            t = self._replace[name]
        elif name in self._index:
            t = self.reader.read_slices(name, self._index[name])
        else:
            return self.reader.read(name, device)
        if self.on_read is not None:
            self.on_read(name, t)
        return t if device is None else t.to(device)

    def shard_layer(self, method: str, name: str, config, plan, spec: ShardSpec, n: int, k: int) -> tuple[int, int]:
        """Register layer ``name``'s slices for ``spec``; returns the rank's (N, K)."""
        probe = QuantLinear(k, n, False, config=config, device="meta")
        why = refusal(probe, spec, name)
        if why is not None:
            raise ShapeError(why)
        length = k if spec.axis == "k" else n
        rs = ranges(spec, length, name)
        for key in self.reader.children(name):
            local = key[len(name) + 1:]
            if method == ct.QUANT_METHOD and local == "weight_shape":
                continue
            axes = _axes(method, local, config, plan)
            if axes is None:
                continue  # the format's loader refuses a tensor it does not know, with its message
            if spec.axis not in axes:
                continue  # the same on every rank (row-wise: a per-channel scale, the bias)
            dim, unit = axes[spec.axis]
            info = self.reader.info(key)
            if dim >= len(info.shape):
                continue  # a shape the format's loader refuses with its own message
            per_dim: list = [None] * len(info.shape)
            per_dim[dim] = [stored_range(lo, hi, length, unit, f"{key}'s units of {unit}", name) for lo, hi in rs]
            self._index[key] = tuple(per_dim)
        local_len = sum(hi - lo for lo, hi in rs)
        n_loc, k_loc = (n, local_len) if spec.axis == "k" else (local_len, k)
        shape_key = f"{name}.weight_shape"
        if method == ct.QUANT_METHOD and shape_key in self.reader:  # pack-quantized records [N, K]
            dt = self.reader.info(shape_key).dtype
            self._replace[shape_key] = torch.tensor([n_loc, k_loc], dtype=dt if isinstance(dt, torch.dtype)
                                                    else torch.int64)
        return n_loc, k_loc


def load_sharded_layer(tp: TensorParallel, reader: ShardedReader, method: str, name: str, linear: nn.Linear,
                       plan, parsed, style: str, *, device, dtype) -> tuple[QuantLinear, list]:
    """The rank's QuantLinear of layer ``name`` (with its style's forward transforms) and the
    checkpoint names it consumed."""
    n, k = linear.out_features, linear.in_features
    spec = tp.spec(style)
    if method == ct.QUANT_METHOD:
        config = plan.config
    elif method == dsf.QUANT_METHOD:
        from ..nn.configs import FP8BlockConfig

        config = FP8BlockConfig()
    else:
        config = plan[0]
    n_loc, k_loc = reader.shard_layer(method, name, config, plan, spec, n, k)
    stand_in = nn.Linear(k_loc, n_loc, bias=linear.bias is not None, device="meta")
    layer, used = load_layer(method, reader, name, stand_in, plan, parsed, device=device, dtype=dtype)
    if spec.axis == "k":  # row-wise: the bias is added once, after the sum of the partial outputs
        bias = layer.bias
        if bias is not None:
            layer._buffers["bias"] = None
            layer._runners = {}
        layer.register_buffer("tp_bias", bias, persistent=False)
    else:
        layer.register_buffer("tp_bias", None, persistent=False)
    tp.install(layer, style, k, n)
    return layer, used


def read_dtensor(reader: CheckpointReader, key: str, current, device) -> nn.Parameter | torch.Tensor:
    """An unquantized parameter that transformers sharded (a DTensor placeholder): the rank's
    slice read from the file, wrapped with the placeholder's mesh and placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = current.placements
    mesh = current.device_mesh
    idx: list = [None] * current.dim()
    for p in placements:
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:
            raise UnsupportedError(expect(key, "a parameter sharded with Shard or Replicate placements",
                                          repr(p)))
        d = p.dim % current.dim()
        lo, hi = chunk(current.shape[d], mesh.get_local_rank(), mesh.size())
        idx[d] = [(lo, hi)]
    t = reader.read_slices(key, tuple(idx)) if any(i is not None for i in idx) else reader.read(key)
    if reader.on_read is not None and any(i is not None for i in idx):
        reader.on_read(key, t)
    if device is not None:
        t = t.to(device)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=current.shape,
                              stride=current.stride())


def start(tp_plan, tp_size):
    """transformers' own set-up of a tensor-parallel load (process group, device mesh):
    (DistributedConfig, the rank's device, mesh); the mesh is None for a world of one process."""
    try:
        from transformers import PreTrainedModel
        from transformers.distributed import DistributedConfig
    except ImportError:  # pragma: no cover - older transformers
        raise UnsupportedError("tileq.from_pretrained(tp_plan=...) needs transformers >= 5.17 "
                               "(transformers.distributed.DistributedConfig)") from None
    if tp_plan is not None and tp_plan != "auto" and not isinstance(tp_plan, dict):
        raise UnsupportedError(expect("tp_plan", "'auto' or a dict {module pattern: style}", repr(tp_plan)))
    dc = DistributedConfig(tp_plan=tp_plan, tp_size=tp_size)
    dc, device_map, mesh = PreTrainedModel.prepare_distribute_model(dc)
    return dc, device_map, mesh


def prepare(model: nn.Module, dist_config, mesh, reader: CheckpointReader) -> tuple[TensorParallel, ShardedReader]:
    """Shard the skeleton as transformers does before it loads weights (DTensor placeholders and
    the styles' forward transforms); the TensorParallel and the reader that slices."""
    model = type(model).maybe_distribute_model(model, dist_config, mesh)
    tp = TensorParallel.of(model)
    if tp is None:  # pragma: no cover - maybe_distribute_model sets the mesh
        raise UnsupportedError(expect("model", "a model transformers sharded", "no device mesh after sharding"))
    return tp, ShardedReader(reader)
