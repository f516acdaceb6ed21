"""``ExpertsSpec``: the shape and recipe of a ``QuantExperts`` (what its forward and the
``tileq::fused_moe`` op need besides the tensors)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..nn.configs import QuantConfig


@dataclass(frozen=True)
class ExpertsSpec:
    """What a QuantExperts forward needs besides its tensors (hashable; ``key`` round-trips through
    ``spec_of_key``, the custom op's string argument)."""

    e: int
    h: int
    i: int
    scheme: str
    act_dtype: str | None
    act_granularity: str | None
    weight_dtype: str
    group_k: int
    group_n: int

    @classmethod
    def of(cls, config: QuantConfig, e: int, h: int, i: int) -> ExpertsSpec:
        return cls(e, h, i, config.scheme, config.act_dtype, config.act_granularity, config.weight_dtype,
                   config.group_k, config.group_n)

    @property
    def key(self) -> str:
        return (f"e={self.e};h={self.h};i={self.i};scheme={self.scheme};act={self.act_dtype}:"
                f"{self.act_granularity};w={self.weight_dtype};gk={self.group_k};gn={self.group_n}")

    def scale_shape(self, n: int, k: int) -> tuple:
        """The stored scale's shape for an [E, n, k] weight."""
        if self.scheme == "rowcol":
            return (self.e, n)
        gn = n if self.group_n == 1 else math.ceil(n / self.group_n)
        return (self.e, gn, math.ceil(k / self.group_k))


@lru_cache(maxsize=1024)
def spec_of_key(key: str) -> ExpertsSpec:
    f = dict(part.split("=", 1) for part in key.split(";"))
    act, gran = f["act"].split(":")
    return ExpertsSpec(int(f["e"]), int(f["h"]), int(f["i"]), f["scheme"], None if act == "None" else act,
                       None if gran == "None" else gran, f["w"], int(f["gk"]), int(f["gn"]))
