"""What a compiled kernel binary uses: registers and spills, read with Triton's own cuobjdump
(the AOT build and its checks)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def tool(name: str) -> str:
    """A CUDA binary tool shipped with Triton's NVIDIA backend (cuobjdump, nvdisasm, ptxas)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin_path: Path) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from cuobjdump's resource report."""
    try:
        out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(cubin_path)],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    spill = (int(stack.group(1)) if stack else 0) + (int(local.group(1)) if local else 0)
    return (int(regs.group(1)) if regs else None), spill
