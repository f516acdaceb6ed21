"""The order in which a tile kernel visits its output tiles (every GEMM kernel and the split-K
reduction's tile layout share it)."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order of output tiles: GROUP_M consecutive row tiles share each column tile while
    it sits in L2. The Gluon kernels (kernels/gluon/ws_gemm.py, int4p/prefill_kernel.py) call it
    too."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
