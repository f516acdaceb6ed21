"""Device facts: what each compute capability can run, and the live GPU's SM count, shared
memory and name. Every planner reads them here (``facts``): from the device a call runs on, or
from the arch a build or ``explain --arch`` names (its typical SM count).

Never fall back to another arch's parameters: an arch missing here raises ArchError naming the
known ones (in one seed design a tile parameter written for one arch compiled on another and
returned zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .dtypes import OperandType
from .errors import ArchError, UnsupportedError, expect


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


# The arch a plan targets where no GPU says otherwise: the interpreter, CPU tensors, ``explain``
# without ``--arch``. The kernels' reference target.
DEFAULT_ARCH = "sm_90"


@dataclass(frozen=True)
class DeviceFacts:
    """What the planners know about the GPU a call runs on (or the arch it is planned for)."""

    arch: ArchInfo
    num_sms: int
    smem_bytes: int
    name: str | None  # the GPU's name (None when planned for an arch, not a device)


def for_arch(name: str) -> DeviceFacts:
    """Facts for a named arch without a device: its typical SM count (builds, ``explain --arch``)."""
    info = get_arch(name)
    return DeviceFacts(info, info.typical_sms, info.smem_bytes, None)


@lru_cache(maxsize=64)
def _cuda_facts(index: int) -> DeviceFacts:
    # Queried lazily (never at import) and cached per device.
    import torch

    props = torch.cuda.get_device_properties(index)
    info = arch_of_capability(torch.cuda.get_device_capability(index))
    return DeviceFacts(info, props.multi_processor_count, info.smem_bytes, props.name)


def facts(device) -> DeviceFacts:
    """The facts of ``device`` (a torch.device): a CUDA device's own, else the default arch's
    (CPU tensors and the interpreter plan for sm_90)."""
    if getattr(device, "type", None) != "cuda":
        return for_arch(DEFAULT_ARCH)
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_facts(index)


def num_sms(device) -> int:
    return facts(device).num_sms


def triton_version() -> str:
    import triton

    return triton.__version__
