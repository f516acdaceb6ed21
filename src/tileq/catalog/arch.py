"""The architecture table: what each compute capability can run.

Never fall back to another arch's parameters: an arch missing here raises ArchError naming the
known ones (in one seed design a tile parameter written for one arch compiled on another and
returned zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..dtypes import OperandType
from ..errors import ArchError, UnsupportedError, expect


@dataclass(frozen=True)
class ArchInfo:
    name: str  # 'sm_90'
    capability: tuple[int, int]
    smem_bytes: int  # shared memory one program may use (opt-in maximum)
    fp8_mma: bool  # native fp8 matrix instructions
    wgmma: bool  # Hopper warpgroup MMA (shows as wgmma in PTX)
    typical_sms: int  # for planning without a device (explain); a live device's count wins

    @property
    def tag(self) -> str:
        """Short form used in kernel instance names: 'sm90'."""
        return self.name.replace("_", "")


ARCHS: dict[str, ArchInfo] = {
    a.name: a
    for a in (
        ArchInfo("sm_80", (8, 0), 166912, fp8_mma=False, wgmma=False, typical_sms=108),
        ArchInfo("sm_89", (8, 9), 101376, fp8_mma=True, wgmma=False, typical_sms=128),
        ArchInfo("sm_90", (9, 0), 232448, fp8_mma=True, wgmma=True, typical_sms=132),
        ArchInfo("sm_100", (10, 0), 232448, fp8_mma=True, wgmma=False, typical_sms=148),
        ArchInfo("sm_120", (12, 0), 101376, fp8_mma=True, wgmma=False, typical_sms=170),
    )
}


def get_arch(name: str) -> ArchInfo:
    """Look up 'sm_90', 'sm90' or '90'; unknown names raise ArchError listing the known ones."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)", str(name).strip().lower())
    key = f"sm_{m.group(1)}" if m else None
    if key not in ARCHS:
        raise ArchError(expect("arch", f"one of {', '.join(ARCHS)}", repr(name)))
    return ARCHS[key]


def arch_of_capability(cap: tuple[int, int]) -> ArchInfo:
    for a in ARCHS.values():
        if a.capability == tuple(cap):
            return a
    raise ArchError(
        expect("device", f"a GPU of compute capability in {', '.join(ARCHS)}", f"sm_{cap[0]}{cap[1]}")
    )


def check_types(arch: ArchInfo, a: OperandType, b: OperandType) -> None:
    """Refuse a pair whose matrix instructions the arch lacks (fp8 before sm_89)."""
    if (a.is_float8 or b.is_float8) and not arch.fp8_mma:
        fp8_archs = ", ".join(n for n, x in ARCHS.items() if x.fp8_mma)
        raise UnsupportedError(
            expect("a, b", f"a pair without fp8/bf8 on {arch.name} (fp8 runs on {fp8_archs})", f"{a}x{b}")
        )
