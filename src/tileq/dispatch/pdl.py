"""Whether tileq's PDL-aware kernels launch with programmatic dependent launch (sm_90+): the
plans state it (``Plan.pdl``) and the API gives the other launchers its answer; the kernels'
device side is ``kernels/pdl.py``."""

from __future__ import annotations

from .. import settings
from ..device import ArchInfo
from ..device import facts as _device_facts
from ..errors import UnsupportedError, expect


def pdl_enabled(device, interpreted: bool, arch: ArchInfo | None = None) -> bool:
    """Whether tileq's PDL-aware kernels launch on ``device`` (a GPU of ``arch``: default the
    device's) with programmatic dependent launch (the CUDA launch attribute
    ProgrammaticStreamSerialization, Triton's ``launch_pdl``): such a kernel may start while the
    kernel before it on the stream still runs, prefetches what no kernel writes and waits
    (``griddepcontrol.wait``) before its first read of anything else and its first write.
    TILEQ_PDL unset: on for sm_90+ GPUs; 0: off; 1: on, refused before sm_90. Never under the
    interpreter (it has no grid dependencies) nor on CPU tensors."""
    if interpreted or getattr(device, "type", None) != "cuda":
        return False
    switch = settings.current().pdl
    if switch is False:
        return False
    arch = arch or _device_facts(device).arch
    if arch.capability < (9, 0):
        if switch:
            raise UnsupportedError(expect("TILEQ_PDL", f"unset or 0 on {arch.name} (programmatic "
                                          "dependent launch needs sm_90 or newer)", "1"))
        return False
    return True
