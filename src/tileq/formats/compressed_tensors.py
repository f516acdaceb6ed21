"""compressed-tensors checkpoints (llm-compressor's output, what vLLM loads), read and written
without importing the ``compressed_tensors`` package: ``config.json``'s ``quantization_config`` is
parsed here with the package's own rules (checked against it by the tests).

Reading maps each targeted ``nn.Linear`` to a tileq config and converts its tensors exactly:

    format            scheme (weights / input activations)                  tileq config
    int-quantized     int8 channel|tensor / int8 token dynamic              A8W8Config
                      int8 channel|tensor / int8 tensor static              A8W8Config + input_scale
    float-quantized   fp8 channel|tensor / fp8 token dynamic                FP8RowConfig
                      fp8 channel|tensor / fp8 tensor static                FP8RowConfig + input_scale
                      fp8 block [128, 128] / fp8 group 128 dynamic          FP8BlockConfig
    pack-quantized    int4 group g|channel / none                           W4A16Config(g | None)
                      int8 channel|tensor / none                            W8A16Config
                      int4 group g|channel / fp8 token dynamic (vLLM W4A8)  W4A8Config(g | None)
    int-quantized     int4 (stored as int8) group g|channel / fp8 token     W4A8Config(g | None)
    (naive-quantized is read like int-/float-quantized: unpacked weights.)

Layout conversions (all exact, no arithmetic on values):

- ``weight_scale``: a per-tensor scale becomes a per-channel [N] vector of the same value; channel
  [N, 1] -> [N]; group [N, K / g] -> [K / g, N] (tileq's b_scale for the logical B = W^T);
  block [ceil(N / 128), ceil(K / 128)] -> its transpose. Scales are upcast to fp32 (bf16 and fp16
  values are exact in fp32).
- ``weight_packed`` (int32, 32 / num_bits values per word, element i of a word at bits
  [i * b, (i + 1) * b), stored value = v + 2^(b-1)): for int4 the word's little-endian bytes hold
  elements (2j, 2j+1) in (low, high) nibbles; tileq's pk_int4 holds them in (high, low) with the
  same +8 offset, so the conversion is a nibble swap of each byte (``ct_packed_to_pk_int4``).
  For int8 each byte is v + 128.

Anything else (asymmetric weights, zero points, activation reordering with g_idx, other bit
widths, dynamic per-tensor activations, output or KV-cache quantization, transforms, sparsity, a
tensor the scheme does not define) is refused with an error naming the layer and the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import DTypeError, ScaleError, ShapeError, UnsupportedError, expect
from .safetensors_io import CheckpointReader, dtype_name

QUANT_METHOD = "compressed-tensors"
# The compressed-tensors release whose rules this module follows (and the tests check against).
CT_VERSION = "0.20.1"

INT_QUANTIZED = "int-quantized"
FLOAT_QUANTIZED = "float-quantized"
NAIVE_QUANTIZED = "naive-quantized"
PACK_QUANTIZED = "pack-quantized"
MIXED = "mixed-precision"
_READABLE_FORMATS = (INT_QUANTIZED, FLOAT_QUANTIZED, NAIVE_QUANTIZED, PACK_QUANTIZED)

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- config parsing


@dataclass(frozen=True)
class Args:
    """The fields of compressed-tensors' QuantizationArgs that decide the stored layout."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # tensor | channel | group | block | token | tensor_group | attn_head
    group_size: int | None
    block_structure: tuple | None
    dynamic: object  # True | False | "local"
    actorder: object

    def describe(self) -> str:
        extra = ""
        if self.strategy == "group":
            extra = f" {self.group_size}"
        elif self.strategy == "block":
            extra = f" {list(self.block_structure)}"
        dyn = "dynamic" if self.dynamic is True else ("static" if self.dynamic is False else f"dynamic={self.dynamic}")
        sym = "" if self.symmetric else " asymmetric"
        return f"{self.type}{self.num_bits} {self.strategy}{extra} {dyn}{sym}"


_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
              "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")


def _check_object(d, keys, where: str, kind: str) -> None:
    """``d`` is a JSON object of compressed-tensors' ``kind`` with no field outside ``keys``."""
    if not isinstance(d, dict):
        raise UnsupportedError(expect(where, f"a {kind} object", type(d).__name__))
    unknown = sorted(set(d) - keys)
    if unknown:
        raise UnsupportedError(expect(where, f"{kind} fields ({', '.join(sorted(keys))})",
                                      f"unknown field(s) {unknown}"))


def parse_args(d, where: str) -> Args | None:
    """QuantizationArgs from its JSON form, with the package's validation rules."""
    if d is None:
        return None
    _check_object(d, _ARGS_KEYS, where, "QuantizationArgs")
    num_bits = d.get("num_bits", 8)
    qtype = str(d.get("type", "int")).lower()
    symmetric = d.get("symmetric", True)
    group_size = d.get("group_size")
    strategy = d.get("strategy")
    block = d.get("block_structure")
    dynamic = d.get("dynamic", False)
    actorder = d.get("actorder")
    if isinstance(dynamic, str):
        dynamic = dynamic.lower()
    if not isinstance(num_bits, int) or isinstance(num_bits, bool) or num_bits < 1:
        raise UnsupportedError(expect(f"{where}.num_bits", "a positive int", repr(num_bits)))
    if qtype not in ("int", "float"):
        raise UnsupportedError(expect(f"{where}.type", "'int' or 'float'", repr(qtype)))
    if not isinstance(symmetric, bool):
        raise UnsupportedError(expect(f"{where}.symmetric", "true or false", repr(symmetric)))
    if group_size is not None and (not isinstance(group_size, int) or isinstance(group_size, bool)
                                   or group_size < -1 or group_size == 0):
        raise UnsupportedError(expect(f"{where}.group_size", "null, -1 or a positive int", repr(group_size)))
    if isinstance(block, str):  # the package accepts "128x128"
        try:
            block = [int(x) for x in block.split("x")]
        except ValueError:
            raise UnsupportedError(expect(f"{where}.block_structure", "[rows, cols]", repr(block))) from None
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise UnsupportedError(expect(f"{where}.block_structure", "[rows, cols] of positive ints", repr(block)))
        block = tuple(block)
    # Strategy inference, as QuantizationArgs.validate_model_after does it.
    if strategy is None:
        if group_size is None:
            strategy = "tensor"
        elif group_size > 0:
            strategy = "group"
        else:
            strategy = "channel"
    strategy = str(strategy).lower()
    if strategy not in _STRATEGIES:
        raise UnsupportedError(expect(f"{where}.strategy", f"one of {', '.join(_STRATEGIES)}", repr(strategy)))
    if strategy in ("group", "tensor_group") and (group_size is None or group_size <= 0):
        raise UnsupportedError(expect(f"{where}.group_size", f"a positive group size for strategy {strategy!r}",
                                      repr(group_size)))
    if group_size is not None and group_size > 0 and strategy not in ("group", "tensor_group"):
        raise UnsupportedError(expect(f"{where}.group_size", f"null for strategy {strategy!r}", repr(group_size)))
    if (strategy == "block") != (block is not None):
        raise UnsupportedError(expect(f"{where}.block_structure", "set exactly when strategy is 'block'",
                                      f"strategy {strategy!r} with block_structure {block!r}"))
    if strategy == "token" and not dynamic:
        raise UnsupportedError(expect(f"{where}.dynamic", "true for strategy 'token'", repr(dynamic)))
    if dynamic not in (True, False, "local"):
        raise UnsupportedError(expect(f"{where}.dynamic", "true, false or 'local'", repr(dynamic)))
    return Args(num_bits, qtype, symmetric, strategy, group_size, block, dynamic, actorder)


@dataclass(frozen=True)
class Scheme:
    name: str  # the config group's name
    targets: tuple
    weights: Args | None
    input_activations: Args | None
    output_activations: Args | None
    format: str  # the group's format, else the checkpoint's


@dataclass(frozen=True)
class CTConfig:
    schemes: tuple
    ignore: tuple
    format: str


_SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}


def _preset(name: str) -> dict:
    """The presets of compressed-tensors' quant_scheme.py that tileq can represent."""
    int8_ch = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
    int8_tok = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    int4g = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
             "dynamic": False}
    presets = {
        "W8A8": {"weights": int8_ch, "input_activations": int8_tok},
        "INT8": {"weights": int8_ch, "input_activations": int8_tok},
        "W4A16": {"weights": int4g},
        "W4A16_ASYM": {"weights": {**int4g, "symmetric": False}},
        "W8A16": {"weights": {**int4g, "num_bits": 8}},
        "W4AFP8": {"weights": int4g, "input_activations": {**fp8, "strategy": "token", "dynamic": True}},
        "FP8": {"weights": {**fp8, "strategy": "tensor"}, "input_activations": {**fp8, "strategy": "tensor"}},
        "FP8_DYNAMIC": {"weights": {**fp8, "strategy": "channel"},
                        "input_activations": {**fp8, "strategy": "token", "dynamic": True}},
        "FP8_BLOCK": {"weights": {**fp8, "strategy": "block", "block_structure": [128, 128]},
                      "input_activations": {**fp8, "strategy": "group", "group_size": 128, "dynamic": True}},
    }
    key = name.upper()
    if key not in presets:
        raise UnsupportedError(expect(f"quantization_config.config_groups.{name}",
                                      f"a scheme object or a preset tileq reads ({', '.join(presets)})",
                                      "an unknown preset name"))
    return presets[key]


def parse_config(qc: dict) -> CTConfig:
    """A compressed-tensors ``quantization_config`` (config.json) -> CTConfig, strictly."""
    where = "quantization_config"
    status = qc.get("quantization_status", "compressed")
    fmt = qc.get("format")
    if status != "compressed":
        raise UnsupportedError(expect(f"{where}.quantization_status", "'compressed' (quantized tensors stored)",
                                      f"{status!r} (weights are not stored quantized)"))
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if qc.get(key):
            raise UnsupportedError(expect(f"{where}.{key}", "empty (tileq does not apply it)",
                                          f"{qc[key]!r}"[:200]))
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedError(expect(f"{where}.config_groups", "a non-empty object", repr(groups)[:200]))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise UnsupportedError(expect(f"{where}.ignore", "a list of module names", repr(ignore)[:200]))
    schemes = []
    for gname, g in groups.items():
        gw = f"{where}.config_groups.{gname}"
        if isinstance(g, list):  # a preset name mapped to its targets
            g = {"targets": g, **_preset(gname)}
        _check_object(g, _SCHEME_KEYS, gw, "QuantizationScheme")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise UnsupportedError(expect(f"{gw}.targets", "a non-empty list of names", repr(targets)))
        gfmt = g.get("format") or fmt
        if gfmt == MIXED or gfmt is None:
            raise UnsupportedError(expect(f"{gw}.format", "a compression format (the checkpoint's format is "
                                                          f"{fmt!r})", repr(g.get("format"))))
        schemes.append(Scheme(gname, tuple(targets), parse_args(g.get("weights"), f"{gw}.weights"),
                              parse_args(g.get("input_activations"), f"{gw}.input_activations"),
                              parse_args(g.get("output_activations"), f"{gw}.output_activations"), gfmt))
    return CTConfig(tuple(schemes), tuple(ignore), fmt)


# ----------------------------------------------------------------------------- target matching


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name


def _match_class(module, target: str) -> bool:
    return any(cls.__name__ == target for cls in type(module).__mro__)


def scheme_for(name: str, module, cfg: CTConfig) -> Scheme | None:
    """The scheme compressed-tensors applies to ``module`` (apply_quantization_config's rules:
    a target matches a module's name exactly, by ``re:`` regex (re.match) or by a class name in its
    MRO; ``ignore`` entries likewise; among matching targets the exact names win, then regexes,
    then class names, and a target named by several groups belongs to the last of them)."""
    target_to_scheme: dict[str, Scheme] = {}
    for s in cfg.schemes:
        for t in s.targets:
            target_to_scheme.pop(t, None)
            target_to_scheme[t] = s
    if not any(_match_name(name, t) or _match_class(module, t) for t in target_to_scheme):
        return None
    if any(_match_name(name, i) or _match_class(module, i) for i in cfg.ignore):
        return None
    ordered = sorted(target_to_scheme, key=lambda x: ("re:" in x, x))
    matched = [t for t in ordered if _match_name(name, t)]
    matched += [t for t in ordered if _match_class(module, t) and t not in matched]
    return target_to_scheme[matched[0]]


# ----------------------------------------------------------------------------- scheme -> tileq config


@dataclass(frozen=True)
class LayerPlan:
    """How one layer is stored and which tileq config it becomes."""

    config: object  # a tileq.nn QuantConfig
    scheme: Scheme
    static_input: bool  # an input_scale tensor is stored (static per-tensor activations)
    weight_kind: str  # "int8" | "int4" | "fp8"


def plan_layer(name: str, scheme: Scheme) -> LayerPlan:
    """The tileq config for ``scheme`` or an UnsupportedError saying why there is none."""
    from ..nn import A8W8Config, FP8BlockConfig, FP8RowConfig, W4A8Config, W4A16Config, W8A16Config

    w, a = scheme.weights, scheme.input_activations
    where = f"{name} (config group {scheme.name!r})"

    def refuse(what: str, why: str):
        raise UnsupportedError(f"{where}: {what}: {why}")

    if scheme.format not in _READABLE_FORMATS:
        refuse("format", f"expected one of {', '.join(_READABLE_FORMATS)}, got {scheme.format!r}")
    if w is None:
        refuse("weights", "expected quantized weights, got none (activation-only quantization)")
    if scheme.output_activations is not None:
        refuse("output_activations", f"output quantization is not supported, got {scheme.output_activations.describe()}")
    if not w.symmetric:
        refuse("weights", "asymmetric weights (zero points) are not supported yet, got "
                          f"{w.describe()}")
    if w.dynamic is not False:
        refuse("weights", f"expected static weight scales, got {w.describe()}")
    if w.actorder not in (None, "weight", "static"):
        refuse("weights.actorder", f"expected null or 'weight' (no g_idx), got {w.actorder!r}")
    # Weights.
    if w.type == "int" and w.num_bits == 8 and w.strategy in ("channel", "tensor"):
        kind, group = "int8", None
    elif w.type == "int" and w.num_bits == 4 and w.strategy in ("channel", "tensor"):
        kind, group = "int4", None
    elif w.type == "int" and w.num_bits == 4 and w.strategy == "group":
        kind, group = "int4", w.group_size
        if group % 2:
            refuse("weights.group_size", f"expected an even group size (int4 packs pairs), got {group}")
    elif w.type == "float" and w.num_bits == 8 and w.strategy in ("channel", "tensor"):
        kind, group = "fp8", None
    elif w.type == "float" and w.num_bits == 8 and w.strategy == "block":
        if tuple(w.block_structure) != (128, 128):
            refuse("weights.block_structure", f"expected [128, 128], got {list(w.block_structure)}")
        kind, group = "fp8", "block"
    else:
        refuse("weights", "expected int8 (channel/tensor), int4 (group/channel/tensor) or fp8 e4m3 "
                          f"(channel/tensor/block [128, 128]) weights, got {w.describe()}")
    if scheme.format == PACK_QUANTIZED and kind == "fp8":
        refuse("format", "pack-quantized stores integer weights, got float weights")
    # Activations.
    static = False
    if a is None:
        if kind == "int8":
            cfg = W8A16Config()
        elif kind == "int4":
            cfg = W4A16Config(group_size=group)
        else:
            refuse("input_activations", "fp8 weights with unquantized activations (W8A16-fp8) have no tileq "
                                        "config")
    else:
        if not a.symmetric:
            refuse("input_activations", f"asymmetric activations are not supported, got {a.describe()}")
        if a.num_bits != 8:
            refuse("input_activations", f"expected 8-bit activations, got {a.describe()}")
        if a.dynamic is True and a.strategy == "token":
            act = "token"
        elif a.dynamic is False and a.strategy == "tensor":
            act, static = "static", True
        elif a.dynamic is True and a.strategy == "group" and a.group_size == 128:
            act = "group128"
        else:
            refuse("input_activations", "expected dynamic per-token, static per-tensor or dynamic 1x128 "
                                        f"activations, got {a.describe()}")
        if a.type == "int" and kind == "int8" and act in ("token", "static"):
            cfg = A8W8Config()
        elif a.type == "float" and kind == "fp8" and group is None and act in ("token", "static"):
            cfg = FP8RowConfig()
        elif a.type == "float" and kind == "fp8" and group == "block" and act == "group128":
            cfg = FP8BlockConfig()
        elif a.type == "float" and kind == "int4" and act in ("token", "static"):
            cfg = W4A8Config(group_size=group)
        else:
            refuse("scheme", f"weights {w.describe()} with activations {a.describe()} have no tileq config")
    return LayerPlan(cfg, scheme, static, kind)


# ----------------------------------------------------------------------------- int packing


def ct_packed_to_pk_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' int32 4-bit packing [N, ceil(K / 8)] -> tileq pk_int4 bytes [N, K / 2].

    Word bits [4i, 4i + 4) hold element i + 8 (i = 0..7); byte j of the word (bits 8j..8j+7)
    therefore holds elements 2j (low nibble) and 2j + 1 (high nibble). pk_int4 puts element 2j in
    the high nibble with the same +8 offset: swap the nibbles of every byte, drop the padding.
    Shifts on the int32 values, not a byte view, so the host's byte order does not matter.
    """
    n = packed.shape[0]
    shifts = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int32)
    b = (packed.unsqueeze(-1) >> shifts) & 0xFF  # [N, W, 4] bytes, little-endian order
    b = b.reshape(n, -1)[:, : k // 2]
    return (((b & 0x0F) << 4) | (b >> 4)).to(torch.uint8).contiguous()


def pk_int4_to_ct_packed(pk: torch.Tensor, k: int) -> torch.Tensor:
    """The exact inverse of ``ct_packed_to_pk_int4``: [N, K / 2] bytes -> int32 [N, ceil(K / 8)]
    with zero padding bits, bit for bit what compressed-tensors' ``pack_to_int32`` writes."""
    n = pk.shape[0]
    words = math.ceil(k / 8)
    b = pk.to(torch.int32)
    b = ((b & 0x0F) << 4) | (b >> 4)
    b = torch.nn.functional.pad(b, (0, 4 * words - b.shape[1]))  # padding nibbles stored as 0
    b = b.reshape(n, words, 4).to(torch.int64)
    shifts = torch.arange(0, 32, 8, device=pk.device, dtype=torch.int64)
    w = (b << shifts).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()


def ct_packed_to_int8(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' int32 8-bit packing [N, ceil(K / 4)] -> int8 [N, K] (byte i = v + 128)."""
    n = packed.shape[0]
    shifts = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int32)
    b = ((packed.unsqueeze(-1) >> shifts) & 0xFF).reshape(n, -1)[:, :k]
    return (b - 128).to(torch.int8).contiguous()


def int8_to_ct_packed(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> compressed-tensors' int32 8-bit packing [N, ceil(K / 4)]."""
    n, k = q.shape
    words = math.ceil(k / 4)
    b = q.to(torch.int64) + 128
    b = torch.nn.functional.pad(b, (0, 4 * words - k)).reshape(n, words, 4)
    shifts = torch.arange(0, 32, 8, device=q.device, dtype=torch.int64)
    w = (b << shifts).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- reading one layer


def _fmt_shape(shape) -> str:
    return str(list(shape))


class _LayerTensors:
    """Reads one layer's tensors, checking each header before reading its data."""

    def __init__(self, reader: CheckpointReader, prefix: str, device):
        self.reader, self.prefix, self.device = reader, prefix, device
        self.consumed: list[str] = []

    def key(self, local: str) -> str:
        return f"{self.prefix}.{local}"

    def has(self, local: str) -> bool:
        return self.key(local) in self.reader

    def require(self, local: str, why: str):
        key = self.key(local)
        if key not in self.reader:
            raise ScaleError(f"{key}: missing ({why})") if "scale" in local else \
                ShapeError(f"{key}: missing ({why})")
        return self.reader.info(key)

    def check(self, local: str, dtypes, shape, why: str):
        info = self.require(local, why)
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        want_d = " or ".join(dtype_name(d) for d in dtypes)
        want = f"{want_d} {_fmt_shape(shape)}" if shape is not None else want_d
        if info.dtype not in dtypes:
            raise DTypeError(f"{info.name}: expected {want} {why}, got {info.describe()}")
        if shape is not None and info.shape != tuple(shape):
            raise ShapeError(f"{info.name}: expected {want} {why}, got {info.describe()}")
        return info

    def read(self, local: str) -> torch.Tensor:
        key = self.key(local)
        self.consumed.append(key)
        return self.reader.read(key, self.device)


def load_layer(reader: CheckpointReader, name: str, linear, plan: LayerPlan, *, device, dtype):
    """Read ``name``'s tensors and return the QuantLinear (on ``device``) they describe."""
    from ..nn import QuantLinear

    n, k = linear.out_features, linear.in_features
    w = plan.scheme.weights
    cfg = plan.config
    lt = _LayerTensors(reader, name, device)
    scheme_words = f"for {plan.scheme.format} {w.describe()} ({cfg.name})"

    # Which tensors this layer may hold: anything else is a scheme tileq would misread.
    allowed = {"weight_scale", "bias"}
    allowed |= {"weight_packed", "weight_shape"} if plan.scheme.format == PACK_QUANTIZED else {"weight"}
    if plan.static_input:
        allowed.add("input_scale")
    for key in reader.children(name):
        local = key[len(name) + 1:]
        if local not in allowed:
            raise UnsupportedError(f"{key}: unexpected tensor {scheme_words} (expected only "
                                   f"{', '.join(sorted(allowed))}); its meaning would be guessed")

    # Weight.
    if plan.scheme.format == PACK_QUANTIZED:
        bits = w.num_bits
        words = math.ceil(k * bits / 32)
        lt.check("weight_packed", torch.int32, (n, words), scheme_words)
        shape_info = lt.check("weight_shape", (torch.int64, torch.int32), (2,), scheme_words)
        shape = lt.read("weight_shape")
        if [int(v) for v in shape.tolist()] != [n, k]:
            raise ShapeError(f"{shape_info.name}: expected [{n}, {k}] (the layer's out x in features), "
                             f"got {[int(v) for v in shape.tolist()]}")
        packed = lt.read("weight_packed")
        if bits == 4:
            weight = ct_packed_to_pk_int4(packed, k)
        else:
            weight = ct_packed_to_int8(packed, k)
        del packed
    else:
        stored = torch.float8_e4m3fn if w.type == "float" else torch.int8
        lt.check("weight", stored, (n, k), scheme_words)
        weight = lt.read("weight")
        if plan.weight_kind == "int4":  # int4 values stored one per int8 (int-quantized W4AFP8)
            lo, hi = int(weight.min()), int(weight.max())
            if lo < -8 or hi > 7:
                raise ScaleError(f"{lt.key('weight')}: expected int4 values in [-8, 7] {scheme_words}, "
                                 f"got min {lo}, max {hi}")
            from ..quant import pack_int4

            weight = pack_int4(weight, dim=1).data

    # Weight scale, in compressed-tensors' shape, then tileq's.
    if w.strategy == "tensor":
        scale_shapes = [(1,), ()]
    elif w.strategy == "channel":
        scale_shapes = [(n, 1), (n,)]
    elif w.strategy == "group":
        g = w.group_size
        if k % g:
            raise ShapeError(f"{name}: group_size {g} does not divide in_features K={k} (compressed-tensors' "
                             "group quantization requires it)")
        scale_shapes = [(n, k // g)]
    else:  # block [128, 128]
        bh, bw = w.block_structure
        scale_shapes = [(math.ceil(n / bh), math.ceil(k / bw))]
    info = lt.require("weight_scale", scheme_words)
    if info.dtype not in _SCALE_DTYPES or info.shape not in scale_shapes:
        want = f"float32/bfloat16/float16 {_fmt_shape(scale_shapes[0])}"
        err = DTypeError if info.dtype not in _SCALE_DTYPES else ShapeError
        raise err(f"{info.name}: expected {want} {scheme_words}, got {info.describe()}")
    s = lt.read("weight_scale").float()
    if w.strategy == "tensor":
        scale = s.reshape(()).expand(n).contiguous()  # exact: every channel has the tensor's scale
    elif w.strategy == "channel":
        scale = s.reshape(n)
    else:
        scale = s.t().contiguous()  # [N, Gk] -> [Gk, N]; block [Gn, Gk] -> [Gk, Gn]
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ScaleError(f"{lt.key('weight_scale')}: expected finite non-negative scales, got "
                         "NaN, inf or negative values")

    # Static activation scale.
    input_scale = None
    if plan.static_input:
        info = lt.require("input_scale", "for static per-tensor activations")
        if info.dtype not in _SCALE_DTYPES or info.shape not in ((1,), ()):
            raise (DTypeError if info.dtype not in _SCALE_DTYPES else ShapeError)(
                f"{info.name}: expected float32/bfloat16/float16 [1] for static per-tensor activations, "
                f"got {info.describe()}")
        input_scale = lt.read("input_scale").float().reshape(())

    bias = None
    if linear.bias is not None:
        lt.check("bias", _SCALE_DTYPES, (n,), "(the layer's bias)")
        bias = lt.read("bias").float()
    elif lt.has("bias"):
        raise UnsupportedError(f"{lt.key('bias')}: unexpected tensor (the model's config builds this layer "
                               "without a bias)")

    layer = QuantLinear.from_quantized(weight, scale, config=cfg, bias=bias, input_scale=input_scale,
                                       in_features=k, dtype=dtype)
    return layer, lt.consumed


# ----------------------------------------------------------------------------- writing


def _args(num_bits: int, qtype: str, strategy: str, *, dynamic: bool, group_size=None, block=None) -> dict:
    """QuantizationArgs in the JSON form compressed-tensors' model_dump writes."""
    d = {"num_bits": num_bits, "type": qtype, "symmetric": True, "group_size": group_size, "strategy": strategy,
         "dynamic": dynamic}
    if block is not None:
        d["block_structure"] = list(block)
    return d


def ct_unrepresentable(layer) -> str | None:
    """Why ``layer`` (a QuantLinear) has no compressed-tensors equivalent, or None."""
    cfg = layer.config
    if cfg.weight_dtype == "int4" and cfg.weight_granularity == "group" and layer.in_features % cfg.group_k:
        return (f"int4 groups of {cfg.group_k} do not divide K={layer.in_features}: compressed-tensors' group "
                "quantization requires whole groups")
    if cfg.name == "FP8Block" and layer.input_scale is not None:
        return "a static activation scale with 1 x 128 activation groups"
    if cfg.name not in ("A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"):
        return f"config {cfg.name}"
    return None


def ct_scheme(layer) -> tuple[dict, str]:
    """(QuantizationScheme JSON without targets, format) for a representable QuantLinear."""
    cfg = layer.config
    static = layer.input_scale is not None
    if cfg.name == "A8W8":
        w = _args(8, "int", "channel", dynamic=False)
        a = _args(8, "int", "tensor", dynamic=False) if static else _args(8, "int", "token", dynamic=True)
        return {"weights": w, "input_activations": a, "output_activations": None}, INT_QUANTIZED
    if cfg.name == "FP8Row":
        w = _args(8, "float", "channel", dynamic=False)
        a = _args(8, "float", "tensor", dynamic=False) if static else _args(8, "float", "token", dynamic=True)
        return {"weights": w, "input_activations": a, "output_activations": None}, FLOAT_QUANTIZED
    if cfg.name == "FP8Block":
        w = _args(8, "float", "block", dynamic=False, block=(cfg.group_n, cfg.group_k))
        a = _args(8, "float", "group", dynamic=True, group_size=cfg.group_k)
        return {"weights": w, "input_activations": a, "output_activations": None}, FLOAT_QUANTIZED
    if cfg.name == "W8A16":
        w = _args(8, "int", "channel", dynamic=False)
        return {"weights": w, "input_activations": None, "output_activations": None}, PACK_QUANTIZED
    # int4: W4A16 / W4A8 (vLLM reads pack-quantized int4 weights with fp8 per-token activations as
    # its W4A8-fp8 scheme).
    if cfg.weight_granularity == "group":
        w = _args(4, "int", "group", dynamic=False, group_size=cfg.group_k)
    else:
        w = _args(4, "int", "channel", dynamic=False)
    a = None
    if cfg.act_dtype == "fp8":
        a = _args(8, "float", "tensor", dynamic=False) if static else _args(8, "float", "token", dynamic=True)
    return {"weights": w, "input_activations": a, "output_activations": None}, PACK_QUANTIZED


def layer_tensors(name: str, layer) -> list:
    """The compressed-tensors tensors of one QuantLinear (exact conversions of tileq's)."""
    cfg = layer.config
    n, k = layer.out_features, layer.in_features
    out = []
    if cfg.weight_dtype == "int4":
        out.append((f"{name}.weight_packed", pk_int4_to_ct_packed(layer.packed_weight(), k)))
        out.append((f"{name}.weight_shape", torch.tensor([n, k], dtype=torch.int64)))
    elif cfg.name == "W8A16":
        out.append((f"{name}.weight_packed", int8_to_ct_packed(layer.weight)))
        out.append((f"{name}.weight_shape", torch.tensor([n, k], dtype=torch.int64)))
    else:
        out.append((f"{name}.weight", layer.weight))
    s = layer.weight_scale
    if cfg.weight_granularity == "col":
        out.append((f"{name}.weight_scale", s.reshape(n, 1)))
    else:  # [Gk, N] -> [N, Gk]; blocks [Gk, Gn] -> [Gn, Gk]
        out.append((f"{name}.weight_scale", s.t().contiguous()))
    if layer.input_scale is not None:
        out.append((f"{name}.input_scale", layer.input_scale.reshape(1)))
    if layer.bias is not None:
        out.append((f"{name}.bias", layer.bias))
    return out


def quantization_config(layers: dict, *, unquantized_linears) -> dict:
    """config.json's quantization_config for ``layers`` ({name: QuantLinear}).

    One scheme for every layer: targets ["Linear"] and every other nn.Linear in ``ignore`` (what
    llm-compressor writes); several: one config group per scheme targeting its layers by name,
    format "mixed-precision" when the groups' formats differ.
    """
    groups: list[tuple[str, dict, list[str]]] = []  # (format, scheme, names)
    for name, layer in layers.items():
        scheme, fmt = ct_scheme(layer)
        for g in groups:
            if g[0] == fmt and g[1] == scheme:
                g[2].append(name)
                break
        else:
            groups.append((fmt, scheme, [name]))
    formats = {g[0] for g in groups}
    config_groups = {}
    if len(groups) == 1:
        fmt, scheme, _ = groups[0]
        config_groups["group_0"] = {"targets": ["Linear"], **scheme, "format": fmt}
        ignore = [n for n in unquantized_linears if n not in layers]
    else:
        for i, (fmt, scheme, names) in enumerate(groups):
            config_groups[f"group_{i}"] = {"targets": list(names), **scheme, "format": fmt}
        ignore = []
    return {
        "quant_method": QUANT_METHOD,
        "format": next(iter(formats)) if len(formats) == 1 else MIXED,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
