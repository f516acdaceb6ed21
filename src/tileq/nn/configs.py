"""Quantization configs for ``tileq.quantize_`` and ``tileq.QuantLinear``: frozen, validated at
construction, one per recipe users know (names follow torchao / compressed-tensors usage).

A config says how the weight is stored and how activations are quantized on every forward call;
``scheme`` is the ``tileq.gemm`` scheme the layer runs. ``group_size=None`` on the int4 configs
means one scale per output channel (the whole K is one group).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ShapeError, UnsupportedError, expect

DEFAULT_SKIP = ("lm_head",)


@dataclass(frozen=True)
class QuantConfig:
    """Base of every config. Subclasses fix the recipe; users set the options below.

    skip_modules: module names (the last component, or a full dotted name) left unquantized;
    the output head stays in its dtype by default, as llm-compressor and vLLM checkpoints do.
    """

    skip_modules: tuple = DEFAULT_SKIP

    # Recipe, fixed per subclass (class attributes, not dataclass fields).
    name = "base"
    act_dtype = None  # None: activations stay in the model's dtype (weight-only); 'int8' | 'fp8'
    act_granularity = None  # 'row' (per token) | 'group' (1 x group_k)
    weight_dtype = "int8"  # 'int8' | 'fp8' | 'int4'
    weight_granularity = "col"  # 'col' (per output channel) | 'group'

    # What transformers reads off a ``quantization_config`` to find its quantizer
    # (``from_pretrained(..., quantization_config=tileq.A8W8Config())``: formats/hf_quantizer.py).
    quant_method = "tileq"

    def __post_init__(self):
        skip = self.skip_modules
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise UnsupportedError(expect("skip_modules", "a tuple of module names", repr(skip)))
        object.__setattr__(self, "skip_modules", tuple(skip))

    def to_dict(self) -> dict:
        """The JSON form (``config_from_dict`` reads it back): what transformers writes into
        config.json for a model being quantized on load."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "skip_modules"}
        return {"quant_method": self.quant_method, "config": self.name, "options": options,
                "skip_modules": list(self.skip_modules)}

    @property
    def scheme(self) -> str:
        if self.weight_granularity == "col":
            return "rowcol"
        return "abquant" if self.act_granularity == "group" else "bquant"

    @property
    def group_k(self) -> int:
        return 128

    @property
    def group_n(self) -> int:
        return 1

    def describe(self) -> str:
        act = "bf16/fp16" if self.act_dtype is None else f"{self.act_dtype} {_act_words(self)}"
        w = f"{self.weight_dtype} {_weight_words(self)}"
        return f"{self.name}: activations {act}, weights {w}, scheme {self.scheme}"

    def cannot_serve(self, in_features: int, out_features: int) -> str | None:
        """Why a Linear of this size cannot use this config (None when it can)."""
        if in_features < 1 or out_features < 1:
            return f"empty layer ({out_features}x{in_features})"
        if self.weight_dtype == "int4" and in_features % 2:
            return f"in_features={in_features} is odd: int4 packs pairs along K"
        return None


def _act_words(c: QuantConfig) -> str:
    return "per token" if c.act_granularity == "row" else f"in 1x{c.group_k} groups"


def _weight_words(c: QuantConfig) -> str:
    if c.weight_granularity == "col":
        return "per channel"
    if c.group_n == 1:
        return f"groups of {c.group_k} along K"
    return f"{c.group_k}x{c.group_n} blocks"


@dataclass(frozen=True)
class A8W8Config(QuantConfig):
    """int8 activations per token (dynamic) x int8 weights per output channel."""

    name = "A8W8"
    act_dtype = "int8"
    act_granularity = "row"
    weight_dtype = "int8"


@dataclass(frozen=True)
class FP8RowConfig(QuantConfig):
    """fp8 e4m3 activations per token (dynamic) x e4m3 weights per output channel."""

    name = "FP8Row"
    act_dtype = "fp8"
    act_granularity = "row"
    weight_dtype = "fp8"


@dataclass(frozen=True)
class FP8BlockConfig(QuantConfig):
    """DeepSeek-style fp8: e4m3 activations in 1 x 128 groups x e4m3 weights in 128 x 128 blocks."""

    block_size: int = 128
    name = "FP8Block"
    act_dtype = "fp8"
    act_granularity = "group"
    weight_dtype = "fp8"
    weight_granularity = "group"

    def __post_init__(self):
        super().__post_init__()
        if self.block_size != 128:
            # The kernels' grouped N scales are 1 or 128 wide (docs/schemes.md section 1).
            raise UnsupportedError(expect("block_size", "128", repr(self.block_size)))

    @property
    def group_k(self) -> int:
        return self.block_size

    @property
    def group_n(self) -> int:
        return self.block_size


@dataclass(frozen=True)
class W8A16Config(QuantConfig):
    """int8 weights per output channel, activations unquantized (bf16/fp16)."""

    name = "W8A16"
    weight_dtype = "int8"


INT4_LAYOUTS = ("prepacked", "pk_int4")


@dataclass(frozen=True)
class _Int4Config(QuantConfig):
    """``int4_layout``: how layers keep their int4 weight in memory. 'prepacked' (default): the
    i4p1 layout of ``tileq.prepacked`` (its kernel: faster at decode), wherever the layer allows it
    (group_size None or a multiple of 128); 'pk_int4': tileq's interchange packing. State dicts
    and checkpoints hold pk_int4 either way."""

    group_size: int | None = 128
    int4_layout: str = "prepacked"
    weight_dtype = "int4"

    def __post_init__(self):
        super().__post_init__()
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2):
            raise ShapeError(expect("group_size", "None (per channel) or an even int >= 2", repr(g)))
        if self.int4_layout not in INT4_LAYOUTS:
            raise UnsupportedError(expect("int4_layout", f"one of {INT4_LAYOUTS}", repr(self.int4_layout)))

    def prepacks(self) -> bool:
        """Whether layers of this config keep their weight prepacked (i4p1)."""
        return self.int4_layout == "prepacked" and (self.group_size is None or self.group_size % 128 == 0)

    @property
    def weight_granularity(self) -> str:  # type: ignore[override]
        return "col" if self.group_size is None else "group"

    @property
    def group_k(self) -> int:
        return 128 if self.group_size is None else self.group_size


@dataclass(frozen=True)
class W4A16Config(_Int4Config):
    """int4 weights (groups of ``group_size`` along K, or per channel with None), activations
    unquantized (bf16/fp16)."""

    name = "W4A16"


@dataclass(frozen=True)
class W4A8Config(_Int4Config):
    """fp8 e4m3 activations per token (dynamic) x int4 weights in groups along K."""

    name = "W4A8"
    act_dtype = "fp8"
    act_granularity = "row"


CONFIGS = {c.name: c for c in (A8W8Config, FP8RowConfig, FP8BlockConfig, W8A16Config, W4A16Config,
                               W4A8Config)}


def config_from_name(name: str, **kwargs) -> QuantConfig:
    """``config_from_name('A8W8')`` (case-insensitive, also 'a8w8config')."""
    key = str(name).lower().removesuffix("config")
    for cname, cls in CONFIGS.items():
        if cname.lower() == key:
            return cls(**kwargs)
    raise UnsupportedError(expect("config", f"one of {', '.join(CONFIGS)}", repr(name)))


def config_from_dict(d: dict) -> QuantConfig:
    """The config ``QuantConfig.to_dict`` described."""
    if not isinstance(d, dict) or "config" not in d:
        raise UnsupportedError(expect("quantization config", "an object with a 'config' name (QuantConfig.to_dict)",
                                      repr(d)))
    options = d.get("options") or {}
    if not isinstance(options, dict):
        raise UnsupportedError(expect("quantization config 'options'", "an object", repr(options)))
    skip = tuple(d.get("skip_modules", DEFAULT_SKIP))
    try:
        return config_from_name(d["config"], skip_modules=skip, **options)
    except TypeError as e:  # an option the config does not take
        raise UnsupportedError(f"quantization config {d['config']!r}: {e}") from None


def weight_scale_shape(config: QuantConfig, out_features: int, in_features: int) -> tuple:
    """The weight scale's shape: the b_scale contract's for the logical B = weight.t()."""
    if config.weight_granularity == "col":
        return (out_features,)
    gk = math.ceil(in_features / config.group_k)
    gn = out_features if config.group_n == 1 else math.ceil(out_features / config.group_n)
    return (gk, gn)

