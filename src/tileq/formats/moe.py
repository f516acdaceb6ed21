"""Routed experts in checkpoints: per-expert tensors in and out of ``QuantExperts``' grouped layout.

Checkpoints store each expert as three linears, as transformers 5.17's weight conversions expect
(``conversion_mapping.py``: ``MergeModulelist`` over the experts, then ``Concatenate`` of gate and
up along N into ``gate_up_proj``)::

    Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, ...  <experts>.{e}.gate_proj / up_proj / down_proj
    Mixtral                                 <...>.block_sparse_moe.experts.{e}.w1 (gate) / w3 (up)
                                            / w2 (down); transformers renames .block_sparse_moe.
                                            to .mlp. (its router included)

Each linear's tensors are those of the checkpoint's format for one ``nn.Linear`` (compressed-tensors
``weight`` / ``weight_packed`` + ``weight_shape`` + ``weight_scale``; DeepSeek fp8 ``weight`` +
``weight_scale_inv``), read and checked by that format's own layer loader, then stacked: gate and
up concatenated along N exactly as ``QuantExperts.gate_up_proj`` holds them, scales in its
``[E, N]`` / ``[E, Gn, Gk]`` layout. No value is dequantized or requantized.

Saving writes the same per-expert compressed-tensors tensors where every projection has an
equivalent there; otherwise (int4 groups that do not divide K, FP8Block with I not a multiple of
128, whose 128-row blocks straddle gate and up) tileq's format, which stores a ``QuantExperts``'
four buffers as they are under an ``experts`` entry of ``quantization_config.layers``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import DTypeError, ShapeError, UnsupportedError, expect
from ..moe.experts import QuantExperts
from . import compressed_tensors as ct
from . import deepseek_fp8 as dsf
from . import tileq_format as tqf
from .safetensors_io import CheckpointReader, dtype_name

# model_type -> (gate, up, down) names of one expert's linears, and the checkpoint's name of
# transformers' ".mlp." (None: the same).
_MIXTRAL = (("w1", "w3", "w2"), ".block_sparse_moe.")
_STYLES = {"mixtral": _MIXTRAL, "minimax": _MIXTRAL}
_DEFAULT = (("gate_proj", "up_proj", "down_proj"), None)


def _style(model):
    return _STYLES.get(getattr(getattr(model, "config", None), "model_type", None), _DEFAULT)


def projections(model) -> tuple[str, str, str]:
    """The checkpoint's names of an expert's gate, up and down linears for ``model``'s family."""
    return _style(model)[0]


def stored_name(model, name: str) -> str:
    """A model name as the family's checkpoints spell it (Mixtral: .mlp. -> .block_sparse_moe.)."""
    mlp = _style(model)[1]
    return name.replace(".mlp.", mlp) if mlp else name


def experts_modules(model) -> list[tuple[str, nn.Module]]:
    """Every unconverted transformers experts module (3-D ``gate_up_proj``), in module order."""
    from ..integrations.hf_moe import is_experts_module

    return [(n, m) for n, m in model.named_modules()
            if n and is_experts_module(m) and not isinstance(m, QuantExperts)]


def quant_experts(model) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


# ----------------------------------------------------------------------------- key renaming


class ModelNamedReader:
    """A CheckpointReader seen under the model's names (Mixtral's ``.block_sparse_moe.`` as
    ``.mlp.``, as transformers renames it). ``info`` keeps the stored name, so errors quote the file."""

    def __init__(self, reader: CheckpointReader, stored_mlp: str):
        self._reader = reader
        self._stored: dict[str, str] = {}
        for key in reader.keys():
            name = key.replace(stored_mlp, ".mlp.")
            if name in self._stored:
                raise ShapeError(expect(name, "one stored copy", f"both {self._stored[name]} and {key}"))
            self._stored[name] = key
        self._children: dict[str, list[str]] | None = None

    def __getattr__(self, attr):  # root, files, metadata, on_read, close: the reader's own
        return getattr(self._reader, attr)

    def keys(self) -> list[str]:
        return list(self._stored)

    def __contains__(self, name: str) -> bool:
        return name in self._stored

    def children(self, prefix: str) -> list[str]:
        if self._children is None:
            self._children = {}
            for name in self._stored:
                self._children.setdefault(name.rpartition(".")[0], []).append(name)
        return list(self._children.get(prefix, ()))

    def info(self, name: str):
        return self._reader.info(self._stored[name])

    def read(self, name: str, device=None) -> torch.Tensor:
        return self._reader.read(self._stored[name], device)

    def read_slices(self, name: str, per_dim) -> torch.Tensor:
        return self._reader.read_slices(self._stored[name], per_dim)


def model_named(model, reader: CheckpointReader):
    """``reader`` under the model's names where the family's checkpoints spell them differently."""
    mlp = _style(model)[1]
    if mlp is None or not any(mlp in k for k in reader.keys()):
        return reader
    return ModelNamedReader(reader, mlp)


# ----------------------------------------------------------------------------- loading


def load_experts(model, reader, method: str, parsed, *, device, dtype, sharded: bool) -> set[str]:
    """Replace every experts module of ``model`` (a skeleton on the meta device) by a filled
    ``QuantExperts`` where the checkpoint stores its experts quantized, or fill its 3-D parameters
    where it stores them unquantized per expert. Returns the tensor names consumed. A checkpoint
    holding the 3-D ``gate_up_proj`` / ``down_proj`` themselves is left to the plain loader."""
    consumed: set[str] = set()
    done = []
    for name, mod in experts_modules(model):
        if method == tqf.QUANT_METHOD and isinstance(parsed.get(name), dict) and "experts" in parsed[name]:
            new, used = _load_tileq(reader, name, mod, parsed[name], device=device, dtype=dtype)
        elif f"{name}.gate_up_proj" in reader:
            continue  # stored as the model's own 3-D parameters
        elif sharded:
            raise UnsupportedError(f"{name}: loading per-expert tensors under tensor parallelism is not supported")
        else:
            new, used = _load_per_expert(model, reader, method, parsed, name, mod, device=device, dtype=dtype)
        if new is not None:
            model.set_submodule(name, new)
            done.append(new)
        consumed.update(used)
    from ..integrations.hf_moe import IMPLEMENTATION

    for new in done:
        if hasattr(new, "_tileq_original"):
            new.config._experts_implementation = IMPLEMENTATION
    return consumed


_PROBE = nn.Linear(1, 1, bias=False, device="meta")  # compressed-tensors matches experts as class "Linear"


def _plan_expert(model, reader, method, parsed, name, key):
    """(config, how to read) of the linear ``key`` (model names), or None when it is unquantized."""
    if method == ct.QUANT_METHOD:
        scheme = ct.scheme_for(stored_name(model, key), _PROBE, parsed)
        if scheme is None:
            return None
        plan = ct.plan_layer(key, scheme)
        if plan.static_input:
            raise UnsupportedError(f"{key}: static activation scales on routed experts are not supported "
                                   f"(config group {scheme.name!r})")
        return plan.config, plan
    if method == dsf.QUANT_METHOD:
        if not dsf.converts(model, parsed, name):
            dsf.check_unquantized(reader, key)
            return None
        from ..nn import FP8BlockConfig

        return FP8BlockConfig(), None
    return None  # tileq's format stores quantized experts whole (see _load_tileq)


def _load_per_expert(model, reader, method, parsed, name, mod, *, device, dtype):
    e, i2, h = mod.gate_up_proj.shape
    i = i2 // 2
    gate, up, down = projections(model)
    shapes = {gate: (i, h), up: (i, h), down: (h, i)}  # (N, K) of each linear
    keys = [(x, p, f"{name}.{x}.{p}") for x in range(e) for p in (gate, up, down)]
    plans = {key: _plan_expert(model, reader, method, parsed, name, key) for _, _, key in keys}
    first = plans[keys[0][2]]
    for _, _, key in keys:
        got = plans[key]
        if (got is None) != (first is None) or (got is not None and got[0] != first[0]):
            words = lambda p: "unquantized" if p is None else p[0].describe()  # noqa: E731
            raise UnsupportedError(f"{key}: quantized as {words(got)} where {keys[0][2]} is {words(first)}: "
                                   f"the experts of {name} must share one quantization (tileq stacks them)")
    if first is None:
        return None, _load_unquantized_experts(reader, name, mod, keys, shapes, device=device, dtype=dtype)

    from ..integrations.hf_moe import empty_like

    config = first[0]
    new = empty_like(mod, config, dtype=dtype)
    if config.weight_granularity == "group" and config.group_n > 1 and i % config.group_n:
        raise UnsupportedError(f"{name}: {config.name} blocks of {config.group_n} rows with intermediate size "
                               f"I={i}: gate's last block is partial, so gate and up blocks cannot be stacked "
                               "into gate_up_proj's blocks")
    consumed: list[str] = []
    parts: dict[str, list] = {"w": [], "s": []}
    per = {}
    for x, p, key in keys:
        n, k = shapes[p]
        w, s, used = _read_linear(reader, method, parsed, key, plans[key], n, k, device=device, dtype=dtype)
        per[p] = (w, s)
        consumed += used
        if p == down:
            parts.setdefault("dw", []).append(w)
            parts.setdefault("ds", []).append(s)
            parts["w"].append(torch.cat([per[gate][0], per[up][0]]))
            parts["s"].append(torch.cat([per[gate][1], per[up][1]]))
            per.clear()
    tensors = {"gate_up_proj": torch.stack(parts["w"]), "gate_up_proj_scale": torch.stack(parts["s"]),
               "down_proj": torch.stack(parts["dw"]), "down_proj_scale": torch.stack(parts["ds"])}
    _adopt(new, tensors, name)
    return new, consumed


def _read_linear(reader, method, parsed, key, plan, n, k, *, device, dtype):
    """One expert linear as (weight, scale) in QuantExperts' per-expert layout, and the names read."""
    linear = SimpleNamespace(out_features=n, in_features=k, bias=None)
    if method == ct.QUANT_METHOD:
        lp = plan[1]
        if lp.config.weight_dtype == "int4":  # pk_int4 bytes, as QuantExperts stores them
            lp = dataclasses.replace(lp, config=dataclasses.replace(lp.config, int4_layout="pk_int4"))
        layer, used = ct.load_layer(reader, key, linear, lp, device=device, dtype=dtype)
    else:
        layer, used = dsf.load_layer(reader, key, linear, parsed, device=device, dtype=dtype)
    s = layer.weight_scale
    return layer.packed_weight(), (s if s.dim() == 1 else s.t().contiguous()), used


def _load_unquantized_experts(reader, name, mod, keys, shapes, *, device, dtype) -> list[str]:
    """An experts module stored unquantized per expert: stacked into its 3-D parameters."""
    gate_up, down, consumed = [], [], []
    pending = []
    for _, p, key in keys:
        wkey = f"{key}.weight"
        extra = [c for c in reader.children(key) if c != wkey]
        if extra:
            raise UnsupportedError(f"{extra[0]}: unexpected tensor (the checkpoint's config leaves {key} unquantized)")
        if wkey not in reader:
            raise ShapeError(f"{wkey}: missing (expert {key.rsplit('.', 2)[-2]} of {name})")
        info = reader.info(wkey)
        if info.shape != shapes[p]:
            raise ShapeError(f"{info.name}: expected shape {list(shapes[p])} (the model's config), got {info.describe()}")
        if not (isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point and info.dtype.itemsize >= 2):
            raise DTypeError(f"{info.name}: expected an unquantized float16/bfloat16/float32 weight, got {info.describe()}")
        pending.append(reader.read(wkey, device).to(dtype))
        consumed.append(wkey)
        if len(pending) == 3:
            gate_up.append(torch.cat(pending[:2]))
            down.append(pending[2])
            pending = []
    mod.gate_up_proj = nn.Parameter(torch.stack(gate_up), requires_grad=False)
    mod.down_proj = nn.Parameter(torch.stack(down), requires_grad=False)
    return consumed


def _adopt(new: QuantExperts, tensors: dict, name: str) -> None:
    for local, shape, dt in new._layout():
        t = tensors[local]
        if t.dtype != dt or tuple(t.shape) != tuple(shape):
            err = DTypeError if t.dtype != dt else ShapeError
            raise err(expect(f"{name}.{local}", f"{dtype_name(dt)} {list(shape)} for {new.quant_config.name} "
                             "experts", f"{dtype_name(t.dtype)} {list(t.shape)}"))
        new._buffers[local] = t.contiguous()


def empty_experts(mod, entry: dict, name: str, *, dtype) -> QuantExperts:
    """An unfilled QuantExperts (buffers on meta) of tileq-format entry ``entry``, standing for
    ``mod``; the entry is checked against the model's shape."""
    from ..integrations.hf_moe import empty_like
    from ..nn import config_from_name

    where = f"quantization_config.layers.{name}"
    try:
        config = config_from_name(entry.get("config"), **(entry.get("options") or {}))
    except TypeError as e:
        raise UnsupportedError(expect(f"{where}.options", "the config's fields", f"{entry.get('options')!r} ({e})")) from None
    new = empty_like(mod, config, dtype=dtype)
    want = experts_entry(new)
    if entry != want:
        bad = next(k for k in sorted(set(want) | set(entry)) if entry.get(k) != want.get(k))
        raise UnsupportedError(expect(f"{where}.{bad}", f"{want.get(bad)!r} for {config.describe()} experts "
                                      f"of the model's shape", repr(entry.get(bad))))
    return new


def _load_tileq(reader, name, mod, entry, *, device, dtype):
    new = empty_experts(mod, entry, name, dtype=dtype)
    config = new.quant_config
    allowed = {local for local, _, _ in new._layout()}
    for key in reader.children(name):
        if key[len(name) + 1:] not in allowed:
            raise UnsupportedError(f"{key}: unexpected tensor for tileq {config.name} experts (expected only "
                                   f"{', '.join(sorted(allowed))})")
    tensors, consumed = {}, []
    for local, shape, dt in new._layout():
        key = f"{name}.{local}"
        if key not in reader:
            raise ShapeError(f"{key}: missing (tileq {config.name} experts store it)")
        info = reader.info(key)
        if info.dtype != dt or info.shape != tuple(shape):
            err = DTypeError if info.dtype != dt else ShapeError
            raise err(f"{key}: expected {dtype_name(dt)} {list(shape)} for tileq {config.name} experts, "
                      f"got {info.describe()}")
        tensors[local] = reader.read(key, device)
        consumed.append(key)
    _adopt(new, tensors, name)
    return new, consumed


# ----------------------------------------------------------------------------- saving


def ct_unrepresentable(mod: QuantExperts) -> str | None:
    """Why ``mod``'s per-expert linears have no compressed-tensors equivalent, or None."""
    c, i = mod.quant_config, mod.intermediate_dim
    if c.weight_granularity == "group" and c.group_n > 1 and i % c.group_n:
        return (f"{c.name} blocks of {c.group_n} rows straddle gate and up (I={i} is not a multiple of "
                f"{c.group_n}): no per-expert gate_proj / up_proj split")
    for n, k in ((i, mod.hidden_dim), (mod.hidden_dim, i)):
        why = ct.ct_unrepresentable(SimpleNamespace(config=c, in_features=k, out_features=n, input_scale=None))
        if why is not None:
            return why
    return None


def _split(mod: QuantExperts, e: int):
    """Expert ``e``'s (gate, up, down) as (weight, scale) in tileq's per-expert layout."""
    i, c = mod.intermediate_dim, mod.quant_config
    rows = i // c.group_n if c.weight_granularity == "group" and c.group_n > 1 else i
    w, s = mod.gate_up_proj[e], mod.gate_up_proj_scale[e]
    return (w[:i], s[:rows]), (w[i:], s[rows:]), (mod.down_proj[e], mod.down_proj_scale[e])


def ct_experts(model, name: str, mod: QuantExperts) -> tuple[dict, list]:
    """({linear name: layer stand-in for ct.quantization_config}, [(tensor name, tensor)]) of the
    experts written per expert as compressed-tensors linears (model names)."""
    c, h, i = mod.quant_config, mod.hidden_dim, mod.intermediate_dim
    layers, tensors = {}, []
    names = projections(model)
    for e in range(mod.num_experts):
        for pname, (w, s) in zip(names, _split(mod, e)):
            n, k = (h, i) if pname == names[2] else (i, h)
            key = f"{name}.{e}.{pname}"
            layers[key] = SimpleNamespace(config=c, in_features=k, out_features=n, input_scale=None)
            if c.weight_dtype == "int4":
                tensors.append((f"{key}.weight_packed", ct.pk_int4_to_ct_packed(w, k)))
                tensors.append((f"{key}.weight_shape", torch.tensor([n, k], dtype=torch.int64)))
            elif c.name == "W8A16":
                tensors.append((f"{key}.weight_packed", ct.int8_to_ct_packed(w)))
                tensors.append((f"{key}.weight_shape", torch.tensor([n, k], dtype=torch.int64)))
            else:
                tensors.append((f"{key}.weight", w.contiguous()))
            # per channel [N] -> [N, 1]; groups and blocks are already compressed-tensors' [Gn, Gk]
            tensors.append((f"{key}.weight_scale", (s.reshape(n, 1) if s.dim() == 1 else s).contiguous()))
    return layers, tensors


def routers(model, experts: dict) -> list[str]:
    """The router linears next to the experts (``<block>.gate`` with a 2-D weight): compressed-tensors
    readers treat them as Linear layers, so a config targeting "Linear" must ignore them."""
    out = []
    for name in experts:
        gate = name.rpartition(".")[0] + ".gate"
        try:
            w = getattr(model.get_submodule(gate), "weight", None)
        except AttributeError:
            continue
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            out.append(gate)
    return out


def experts_entry(mod: QuantExperts) -> dict:
    """tileq's format: the metadata of one QuantExperts (its buffers are stored as they are)."""
    return {"config": mod.quant_config.name, "options": tqf.config_options(mod.quant_config),
            "experts": {"num_experts": mod.num_experts, "hidden_dim": mod.hidden_dim,
                        "intermediate_dim": mod.intermediate_dim,
                        "tensors": {local: {"dtype": dtype_name(dt), "shape": list(shape)}
                                    for local, shape, dt in mod._layout()}}}


def tileq_experts(name: str, mod: QuantExperts) -> list:
    return [(f"{name}.{local}", getattr(mod, local)) for local, _, _ in mod._layout()]


def to_stored(model, tensors: list, qconfig: dict) -> tuple[list, dict]:
    """Tensor names (and compressed-tensors' targets and ignore list) as the family's checkpoints
    spell them (Mixtral: .block_sparse_moe.)."""
    if _style(model)[1] is None:
        return tensors, qconfig
    rename = lambda n: stored_name(model, n)  # noqa: E731
    tensors = [(rename(n), t) for n, t in tensors]
    if "config_groups" in qconfig:  # tileq's format names modules as the model does
        groups = {g: {**v, "targets": [rename(t) for t in v["targets"]]} for g, v in qconfig["config_groups"].items()}
        qconfig = {**qconfig, "config_groups": groups, "ignore": [rename(n) for n in qconfig["ignore"]]}
    return tensors, qconfig

