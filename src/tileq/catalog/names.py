"""Formatting and parsing of kernel names (the one place that knows the grammar).

family:   {scheme}_{a}x{b}_{layout}_{pipeline}[_{scale_layout}]   e.g. aquant_i4xfp8_crr_preshufflequant
instance: {family}__{config tag}_{arch}                          e.g. rowcol_i8xi8_rcr_prefill__m128n128k128_w8_s4_sm90

Names key the compiled-kernel manifest and the tuned tables, so ``parse(format(x)) == x`` is
tested and tests/golden_kernel_names.txt makes any rename a reviewed change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..dtypes import OperandType
from ..problem import LAYOUTS, Scheme
from ..kernels.config import TileConfig

PIPELINES = ("prefill", "decode", "preshufflequant")
SCALE_LAYOUTS = ("preshuffled",)


@dataclass(frozen=True)
class KernelFamily:
    scheme: Scheme
    a: OperandType
    b: OperandType
    layout: str
    pipeline: str
    scale_layout: str | None = None

    @property
    def name(self) -> str:
        return format_family(self)


@dataclass(frozen=True)
class KernelInstance:
    family: KernelFamily
    config: TileConfig
    arch: str  # 'sm_90'

    @property
    def name(self) -> str:
        return format_instance(self)


def format_family(f: KernelFamily) -> str:
    name = f"{f.scheme.value}_{f.a.value}x{f.b.value}_{f.layout}_{f.pipeline}"
    return name + (f"_{f.scale_layout}" if f.scale_layout else "")


_FAMILY = re.compile(
    r"(?P<scheme>[a-z]+)_(?P<a>[a-z0-9]+)x(?P<b>[a-z0-9]+)_(?P<layout>[rc]{2}r)_"
    r"(?P<pipeline>[a-z]+)(?:_(?P<scale_layout>[a-z]+))?"
)


def parse_family(name: str) -> KernelFamily:
    m = _FAMILY.fullmatch(name)
    if not m:
        raise ValueError(f"kernel family: expected {{scheme}}_{{a}}x{{b}}_{{layout}}_{{pipeline}}, got {name!r}")
    try:
        fam = KernelFamily(
            Scheme(m["scheme"]), OperandType(m["a"]), OperandType(m["b"]), m["layout"],
            m["pipeline"], m["scale_layout"],
        )
    except ValueError as e:
        raise ValueError(f"kernel family {name!r}: {e}") from None
    if fam.layout not in LAYOUTS or fam.pipeline not in PIPELINES or (
        fam.scale_layout is not None and fam.scale_layout not in SCALE_LAYOUTS
    ):
        raise ValueError(f"kernel family {name!r}: unknown layout, pipeline or scale layout")
    return fam


def format_instance(inst: KernelInstance) -> str:
    return f"{format_family(inst.family)}__{inst.config.tag}_{inst.arch.replace('_', '')}"


def parse_instance(name: str) -> KernelInstance:
    fam, sep, rest = name.partition("__")
    m = re.fullmatch(r"(.+)_(sm\d+)", rest)
    if not sep or not m:
        raise ValueError(f"kernel instance: expected {{family}}__{{config}}_sm<NN>, got {name!r}")
    arch = "sm_" + m.group(2)[2:]
    return KernelInstance(parse_family(fam), TileConfig.parse_tag(m.group(1)), arch)
