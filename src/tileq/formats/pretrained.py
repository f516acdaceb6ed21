"""``from_pretrained`` / ``save_pretrained``: quantized Hugging Face checkpoints in and out of tileq.

``from_pretrained(path)`` reads ``config.json``, builds the transformers model it describes with
its parameters on the meta device (no memory, no random init), replaces every quantized
``nn.Linear`` by an empty-shell ``tileq.nn.QuantLinear`` of the right config, then streams the
tensors from the safetensors files one at a time straight to ``device``, converting layouts
exactly (never dequantizing). The format is read from ``quantization_config.quant_method``:
``compressed-tensors``, ``fp8`` (DeepSeek style) or ``tileq``.

``save_pretrained(model, path)`` writes compressed-tensors wherever every quantized layer has an
equivalent there (so vLLM and transformers load it) and tileq's format otherwise.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import extensions
from ..errors import CheckpointError, DTypeError, ShapeError, TileqError, UnsupportedError, expect
from ..integrations import compat
from ..nn.configs import INT4_LAYOUTS
from . import compressed_tensors as ct
from . import deepseek_fp8 as dsf
from . import moe as moe_fmt
from . import tileq_format as tqf
from .layer import load_layer
from .safetensors_io import CheckpointReader, dtype_name, read_json, write_checkpoint, write_json

FORMATS = (ct.QUANT_METHOD, dsf.QUANT_METHOD, tqf.QUANT_METHOD)


# ----------------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class TensorParallelPaths:
    """The steps of ``from_pretrained(tp_plan=...)`` and of ``save_pretrained`` on a sharded model.
    ``tileq.distributed`` provides them: it sits above this package (its loader reads a rank's
    slice through the formats' own loaders)."""

    start: Callable  # (tp_plan, tp_size) -> (transformers' DistributedConfig, the rank's device, mesh)
    prepare: Callable  # (skeleton, DistributedConfig, mesh, reader) -> (TensorParallel, the rank's reader)
    load_layer: Callable  # (tp, reader, method, name, linear, plan, parsed, style, device=, dtype=) -> (layer, used)
    read_dtensor: Callable  # (reader, key, placeholder, device): an unquantized tensor's slice
    of_model: Callable  # (model) -> its TensorParallel, None where the mesh shards nothing
    gather_for_save: Callable  # (tp, model, layers, merged, plain_state): full layers on rank 0 (a collective)
    after_save: Callable  # (tp, format or None): rank 0's answer on every rank


# A function returning the paths (importing their modules on a sharded model's first call only),
# registered by tileq.distributed when imported (tileq.extensions imports it).
_tensor_parallel: Callable[[], TensorParallelPaths] | None = None


def register_tensor_parallel(paths: Callable[[], TensorParallelPaths]) -> None:
    global _tensor_parallel
    _tensor_parallel = paths


def _tensor_parallel_paths(call: str) -> TensorParallelPaths:
    extensions.load()
    if _tensor_parallel is None:
        raise UnsupportedError(f"{call} needs tileq.distributed, which registered no tensor-parallel paths (it "
                               "could not be imported: `import tileq.distributed` says why)")
    return _tensor_parallel()


# ----------------------------------------------------------------------------- the model skeleton


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device, buffers (RoPE tables, ...) on the CPU as usual.

    Unlike ``with torch.device("meta")`` this keeps the non-persistent buffers a model computes in
    its constructor, which no checkpoint holds.
    """
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _build_skeleton(path: Path, dtype, trust_remote_code: bool, model_class):
    try:
        import transformers
    except ImportError:  # pragma: no cover - the optional dependency
        raise UnsupportedError("tileq.from_pretrained needs transformers (pip install 'tileq[hf]')") from None
    compat.require_supported("tileq.from_pretrained")
    config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # tileq does the quantization; transformers must not
    cls = model_class or transformers.AutoModelForCausalLM
    with _parameters_on_meta():
        model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, layer)


# ----------------------------------------------------------------------------- from_pretrained


def from_pretrained(path, *, device=None, dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False,
                    model_class=None, on_read=None, int4_layout: str = "prepacked", tp_plan=None,
                    tp_size: int | None = None):
    """Load a quantized checkpoint directory into a transformers model with tileq layers.

    ``device``: where every tensor goes (default CPU; each tensor is read, moved there and dropped
    from host memory before the next is read). ``dtype``: the model's compute dtype (unquantized
    weights are cast to it; quantized ones are kept exactly). ``model_class``: a transformers
    auto class or model class (default ``AutoModelForCausalLM``). ``on_read(name, host_tensor)``
    is called for each tensor read (tests instrument host memory with it). ``int4_layout``: how
    int4 layers hold their weights in memory ('prepacked', the default, or 'pk_int4'; see
    ``W4A16Config``); the file's pk_int4 bytes are converted exactly.

    ``tp_plan`` ('auto' or a dict, as transformers takes it; run under ``torchrun``): the model is
    sharded by transformers' tensor parallelism and each rank reads only its slice of every
    sharded tensor (``tileq.distributed``; docs/tensor-parallel.md). ``device`` then defaults to
    the rank's GPU.

    Formats (``config.json``'s ``quantization_config.quant_method``): ``compressed-tensors``
    (int-quantized, float-quantized, naive-quantized, pack-quantized), ``fp8`` (DeepSeek-style
    128 x 128 blocks) and ``tileq``. Anything not understood raises a ``tileq.errors`` error naming
    the layer and tensor.
    """
    _check_directory(path)
    path = Path(path)
    cfg_json = read_json(path / "config.json", "config.json")
    qc = cfg_json.get("quantization_config")
    if qc is None:
        raise UnsupportedError(expect(f"{path / 'config.json'}: quantization_config",
                                      f"a quantized checkpoint ({', '.join(FORMATS)})",
                                      "none (an unquantized model: load it with transformers and call "
                                      "tileq.quantize_)"))
    if not isinstance(qc, dict):
        raise UnsupportedError(expect("quantization_config", "an object", type(qc).__name__))
    method = qc.get("quant_method")
    if method not in FORMATS:
        raise UnsupportedError(expect("quantization_config.quant_method", f"one of {', '.join(FORMATS)}",
                                      repr(method)))
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(expect("dtype", "torch.bfloat16, torch.float16 or torch.float32", dtype))
    device = torch.device(device) if device is not None else None
    if int4_layout not in INT4_LAYOUTS:
        raise UnsupportedError(expect("int4_layout", f"one of {INT4_LAYOUTS}", repr(int4_layout)))

    # Parse everything before reading any tensor data.
    if method == ct.QUANT_METHOD:
        parsed = ct.parse_config(qc)
    elif method == dsf.QUANT_METHOD:
        parsed = dsf.parse_config(qc)
    else:
        parsed = tqf.parse_config(qc)
    tp = dist_config = None
    if tp_plan is not None or tp_size is not None:
        tp_paths = _tensor_parallel_paths("from_pretrained(tp_plan=...)")
        dist_config, tp_device, mesh = tp_paths.start(tp_plan, tp_size)
        if device is None and tp_device is not None:
            device = torch.device(tp_device)
    with CheckpointReader(path, on_read=on_read) as reader:
        _refuse_fused(reader)
        model = _build_skeleton(path, dtype, trust_remote_code, model_class)
        reader = moe_fmt.model_named(model, reader)  # Mixtral's block_sparse_moe, as transformers renames it
        if dist_config is not None and mesh is not None:  # transformers shards the skeleton
            tp, reader = tp_paths.prepare(model, dist_config, mesh, reader)
        plans = _plan(model, method, parsed, reader)
        _check_not_tied(model, plans)
        with torch.no_grad():
            # Routed experts: per-expert tensors stacked into QuantExperts (formats/moe.py).
            consumed = moe_fmt.load_experts(model, reader, method, parsed, device=device, dtype=dtype,
                                            sharded=tp is not None)
            for name, plan in plans.items():
                linear = model.get_submodule(name)
                style = tp.style(name) if tp is not None else None
                try:
                    if style is not None:  # this rank's slice, with the tp_plan's forward transforms
                        layer, used = tp_paths.load_layer(tp, reader, method, name, linear, plan, parsed, style,
                                                          device=device, dtype=dtype)
                    else:
                        layer, used = load_layer(method, reader, name, linear, plan, parsed, device=device,
                                                 dtype=dtype)
                except TileqError as e:
                    if name in str(e):
                        raise
                    raise type(e)(f"{name}: {e}") from None
                if layer.config.weight_dtype == "int4" and layer.config.int4_layout != int4_layout:
                    layer.set_int4_layout(int4_layout)
                layer.qualified_name = name  # errors about the layer's input name it
                _replace(model, name, layer)
                consumed.update(used)
            consumed |= _load_unquantized(model, reader, device, dtype,
                                          tp_paths.read_dtensor if tp is not None else None)
        _check_leftovers(model, reader, consumed)
    model.eval()
    model.tileq_checkpoint_format = method
    return model


def _check_directory(path) -> None:
    """A CheckpointError unless ``path`` is a directory; one that reads as a Hugging Face Hub id
    (``org/name``) is told that nothing is downloaded."""
    p = Path(path)
    if p.is_dir():
        return
    text = str(path)
    if p.exists():
        raise CheckpointError(expect("path", "a checkpoint directory (holding config.json and *.safetensors)",
                                     f"{text} (not a directory)"))
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):
        raise CheckpointError(
            f"{text}: no such directory. tileq.from_pretrained reads a local checkpoint directory and "
            f"downloads nothing from the Hugging Face Hub: download it first, e.g. `huggingface-cli "
            f"download {text} --local-dir DIR` or huggingface_hub.snapshot_download({text!r}), and pass "
            f"that directory. It must hold a quantized checkpoint (compressed-tensors, DeepSeek fp8 or "
            f"tileq's); an unquantized model is loaded with transformers and quantized with tileq.quantize_")
    raise CheckpointError(expect("path", "a checkpoint directory (holding config.json and *.safetensors)",
                                 f"{text} (no such directory)"))


_FUSED = (".self_attn.qkv_proj.", ".mlp.gate_up_proj.")


def _refuse_fused(reader: CheckpointReader) -> None:
    """A checkpoint of a decoder fused by ``tileq.integrations.hf.fuse_decoder_`` (merged q/k/v and
    gate/up tensors), which a model built from its config has no place for: say so."""
    fused = next((k for k in reader.keys() if any(f in k for f in _FUSED)), None)
    if fused is not None:
        raise CheckpointError(
            f"{fused}: this checkpoint holds a fused decoder's merged projections (self_attn.qkv_proj, "
            f"mlp.gate_up_proj), written from a model fused with tileq.integrations.hf.fuse_decoder_ by a "
            f"tileq that saved fused layers as they were; the model's config builds q/k/v_proj and "
            f"gate/up_proj. Save the model again with this tileq (save_pretrained writes the standard layout "
            f"from a fused model), then call fuse_decoder_ after loading")


def _plan(model, method: str, parsed, reader: CheckpointReader) -> dict:
    """{module name: what the loader needs} for every quantized nn.Linear, in module order."""
    plans = {}
    if method == ct.QUANT_METHOD:
        for name, module in model.named_modules():
            scheme = ct.scheme_for(name, module, parsed)
            if scheme is None:
                continue
            if isinstance(module, nn.Embedding):
                raise UnsupportedError(f"{name}: quantized embeddings (config group {scheme.name!r}) are not supported")
            if not isinstance(module, nn.Linear):
                continue  # compressed-tensors quantizes only Linear and Embedding modules
            plans[name] = ct.plan_layer(name, scheme)
    elif method == dsf.QUANT_METHOD:
        quantized = set(dsf.quantized_layers(model, parsed))
        for name, module in model.named_modules():
            if name in quantized:
                plans[name] = None
            elif isinstance(module, nn.Linear):
                dsf.check_unquantized(reader, name)
    else:
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name in parsed:
            if name not in linears and not (isinstance(parsed[name], dict) and "experts" in parsed[name]):
                raise UnsupportedError(expect(f"quantization_config.layers.{name}",
                                              "the name of an nn.Linear of the model", "no such layer"))
        for name, module in linears.items():
            if name in parsed:
                plans[name] = tqf.plan_layer(name, parsed[name], module)
    return plans


def _check_not_tied(model, plans: dict) -> None:
    groups: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(pname)
    for names in groups.values():
        if len(names) > 1:
            for n in names:
                layer = n.rpartition(".")[0]
                if layer in plans:
                    raise UnsupportedError(f"{n}: a quantized layer whose weight is tied to "
                                           f"{', '.join(x for x in names if x != n)} is not supported")


def _load_unquantized(model, reader: CheckpointReader, device, dtype, read_dtensor=None) -> set[str]:
    """Every remaining parameter and persistent buffer, read as stored (floats cast to ``dtype``).
    Tied parameters (one object under several names) are read once, from whichever name is stored.
    ``read_dtensor(reader, key, placeholder, device)`` reads the parameters that tensor
    parallelism sharded (DTensor placeholders)."""
    consumed = set()
    by_object: dict[int, list[tuple[str, nn.Module, str, bool]]] = {}
    for mname, module in model.named_modules():
        if type(module).__module__.startswith("tileq."):
            continue
        for local, p in module._parameters.items():
            if p is not None:
                by_object.setdefault(id(p), []).append((f"{mname}.{local}" if mname else local, module, local, True))
        for local, b in module._buffers.items():
            if b is not None and local not in module._non_persistent_buffers_set:
                by_object.setdefault(id(b), []).append((f"{mname}.{local}" if mname else local, module, local, False))
    for entries in by_object.values():
        stored = [e for e in entries if e[0] in reader]
        if not stored:
            first = entries[0]
            t = getattr(first[1], first[2])
            if t.device.type == "meta":
                names = ", ".join(e[0] for e in entries)
                raise ShapeError(f"{names}: missing from the checkpoint")
            continue  # a buffer the model computes itself
        key = stored[0][0]
        module, local, is_param = stored[0][1], stored[0][2], stored[0][3]
        current = getattr(module, local)
        info = reader.info(key)
        if info.shape != tuple(current.shape):
            raise ShapeError(f"{key}: expected shape {list(current.shape)} (the model's config), got {info.describe()}")
        if current.dtype.is_floating_point:
            ok = isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point and info.dtype.itemsize >= 2
            if not ok:
                raise DTypeError(f"{key}: expected an unquantized float16/bfloat16/float32 tensor (this layer is "
                                 f"not quantized under the checkpoint's config), got {info.describe()}")
        elif info.dtype != current.dtype:
            raise DTypeError(f"{key}: expected {dtype_name(current.dtype)}, got {info.describe()}")
        if read_dtensor is not None and type(current).__name__ == "DTensor":
            t = read_dtensor(reader, key, current, device)
        else:
            t = reader.read(key, device)
        if t.dtype.is_floating_point and t.dtype != dtype:
            t = t.to(dtype)
        new = nn.Parameter(t, requires_grad=False) if is_param else t
        for _, m, loc, is_p in entries:
            if is_p:
                m._parameters[loc] = new
            else:
                m._buffers[loc] = new
        consumed.update(e[0] for e in stored)
    # Buffers the model computed in its constructor (not stored) follow the model to the device.
    if device is not None:
        for mname, module in model.named_modules():
            for local, b in list(module._buffers.items()):
                if b is not None and b.device != device and b.device.type != "meta" \
                        and not type(module).__module__.startswith("tileq."):
                    module._buffers[local] = b.to(device)
    return consumed


def _check_leftovers(model, reader: CheckpointReader, consumed: set[str]) -> None:
    non_persistent = set()
    for mname, module in model.named_modules():
        for local in module._non_persistent_buffers_set:
            non_persistent.add(f"{mname}.{local}" if mname else local)
    left = [k for k in reader.keys() if k not in consumed and k not in non_persistent]
    if left:
        more = f" and {len(left) - 5} more" if len(left) > 5 else ""
        raise UnsupportedError(f"{', '.join(left[:5])}{more}: tensors in the checkpoint that neither the model nor "
                               "the quantization config accounts for (tileq would have to guess their meaning)")


# ----------------------------------------------------------------------------- save_pretrained


def save_pretrained(model, path, *, format: str = "auto", max_shard_size="5GB") -> str:
    """Write ``model`` (a transformers model with tileq ``QuantLinear`` layers) to ``path``.

    ``format="auto"`` writes compressed-tensors when every quantized layer has an equivalent there
    (A8W8 -> int-quantized, FP8Row / FP8Block -> float-quantized, W8A16 / W4A16 / W4A8 ->
    pack-quantized; see ``compressed_tensors.ct_scheme``) and tileq's format otherwise;
    ``"compressed-tensors"`` refuses a model it cannot represent; ``"tileq"`` always writes
    tileq's format. Returns the format written. Reloading with ``from_pretrained`` gives back the
    same tensors bit for bit.
    """
    if format not in ("auto", ct.QUANT_METHOD, tqf.QUANT_METHOD):
        raise UnsupportedError(expect("format", "'auto', 'compressed-tensors' or 'tileq'", repr(format)))
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise UnsupportedError(expect("model", "a transformers model (with a .config)", type(model).__name__))
    from ..integrations.hf import unfused_layers

    # A fused decoder (fuse_decoder_) is written in the standard layout: its merged q/k/v and
    # gate/up layers split back (copies; the model stays fused).
    layers, merged = unfused_layers(model)
    tp = plain = None
    if getattr(model, "_device_mesh", None) is not None:  # sharded: one checkpoint, gathered on rank 0
        tp_paths = _tensor_parallel_paths("save_pretrained of a sharded model")
        tp = tp_paths.of_model(model)
        if tp is not None:
            layers, plain = tp_paths.gather_for_save(tp, model, layers, merged, _plain_state)
            if layers is None:  # not rank 0: wait for its files, return its answer
                return tp_paths.after_save(tp, None)
    experts = moe_fmt.quant_experts(model)
    if experts and tp is not None:
        raise UnsupportedError(f"{next(iter(experts))}: saving quantized experts under tensor parallelism is "
                               "not supported")
    if not layers and not experts:
        raise UnsupportedError(expect("model", "a model with tileq QuantLinear layers (see tileq.quantize_)",
                                      "no QuantLinear layer"))
    reasons = {name: ct.ct_unrepresentable(layer) for name, layer in layers.items()}
    reasons.update({name: moe_fmt.ct_unrepresentable(mod) for name, mod in experts.items()})
    blocked = {n: r for n, r in reasons.items() if r}
    if format == ct.QUANT_METHOD and blocked:
        name, why = next(iter(blocked.items()))
        raise UnsupportedError(f"{name}: no compressed-tensors equivalent ({why}); use format='tileq' or 'auto'")
    fmt = tqf.QUANT_METHOD if format == tqf.QUANT_METHOD or blocked else ct.QUANT_METHOD

    tensors = []
    for name, t in plain if plain is not None else _plain_state(model, set(layers) | merged | set(experts)):
        tensors.append((name, t))
    for name, layer in layers.items():
        tensors += ct.layer_tensors(name, layer) if fmt == ct.QUANT_METHOD else tqf.layer_tensors(name, layer)
    if fmt == ct.QUANT_METHOD:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        ct_layers = dict(layers)
        for name, mod in experts.items():  # each expert's gate / up / down as a compressed-tensors linear
            stand_ins, expert_tensors = moe_fmt.ct_experts(model, name, mod)
            ct_layers.update(stand_ins)
            tensors += expert_tensors
        qconfig = ct.quantization_config(ct_layers, unquantized_linears=linears + moe_fmt.routers(model, experts))
    else:
        qconfig = tqf.quantization_config(layers)
        for name, mod in experts.items():
            qconfig["layers"][name] = moe_fmt.experts_entry(mod)
            tensors += moe_fmt.tileq_experts(name, mod)
    tensors, qconfig = moe_fmt.to_stored(model, tensors, qconfig)

    from ..version import __version__

    path = Path(path)
    write_checkpoint(tensors, path, max_shard_size=max_shard_size,
                     metadata={"producer": f"tileq {__version__}", "tileq_format": fmt})
    cfg = json.loads(config.to_json_string(use_diff=False))
    cfg["quantization_config"] = qconfig
    write_json(path / "config.json", cfg)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(str(path))
        except Exception:  # noqa: BLE001 - a generation config is optional; weights and config are written
            pass
    return tp_paths.after_save(tp, fmt) if tp is not None else fmt


def _plain_state(model, layers):
    """(name, tensor) for every persistent parameter / buffer outside the QuantLinear layers; a
    parameter shared under several names (tied embeddings) is written once, under its first name,
    as transformers does (the loader's model re-ties it)."""
    seen: set[int] = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        if mname in layers or any(mname.startswith(q + ".") for q in layers):
            continue
        for local, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mname}.{local}" if mname else local), p.detach()
        for local, b in module._buffers.items():
            if b is None or local in module._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            yield (f"{mname}.{local}" if mname else local), b
