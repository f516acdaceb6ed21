"""Programmatic dependent launch (PDL, sm_90+): the device side of tileq's PDL-aware kernels.

A kernel launched with PDL (``dispatch.pdl.pdl_enabled``) may start while the kernel before it on the
stream is still running. Until ``wait_upstream`` returns it must neither read anything an earlier
kernel may write nor write anything an earlier kernel may still read (scratch buffers are reused
from layer to layer). What it may do before: address arithmetic and L2 prefetches
(``prefetch_l2``): a prefetch only moves lines into L2, the point of coherence, so even a line
being written upstream is read correctly after the wait. Without the launch attribute
``griddepcontrol.wait`` returns at once and the kernel behaves as an ordinary one.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_upstream():
    """Wait until the kernels before this one on the stream have finished and their writes are
    visible, then let the next PDL kernel start its own prologue (its first wait still waits for
    this kernel to finish, so the order of every read and write is kept)."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, r0, R: tl.constexpr, r_count, pitch, c0, C: tl.constexpr, c_count):
    """Ask L2 for bytes [c0, c0 + C) of rows r0 .. r0 + R - 1 of the byte matrix at ``ptr`` (row
    pitch ``pitch`` bytes): one ``prefetch.global.L2`` per 128-byte line. Rows and byte offsets
    are clamped to the ``r_count`` rows and ``c_count`` bytes per row that exist, so no address
    lies outside the operand. Nothing reaches registers."""
    LINES: tl.constexpr = (C + 127) // 128
    rows = tl.maximum(tl.minimum(r0 + tl.arange(0, R), r_count - 1), 0)
    cols = tl.maximum(tl.minimum(c0 + tl.arange(0, LINES) * 128, c_count - 1), 0)
    p = ptr.to(tl.pointer_type(tl.int8)) + rows.to(tl.int64)[:, None] * pitch + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_tile(ptr, ld, T: tl.constexpr, K_CONTIG: tl.constexpr, o0, O: tl.constexpr, o_count,
                  k0, BK: tl.constexpr, K):
    """L2 prefetch of one [O, BK] tile of a GEMM operand (storage type T, leading dimension ``ld``
    in storage elements): O rows or columns from ``o0`` (``o_count`` exist) by BK of K from
    ``k0``, stored with K contiguous (``K_CONTIG``) or with the other dimension contiguous.
    Packed int4 ('i4') holds two values per byte along its contiguous dimension."""
    if T == "bf16" or T == "fp16":
        EB: tl.constexpr = 2
    else:
        EB: tl.constexpr = 1
    if T == "i4":
        PACK: tl.constexpr = 2
    else:
        PACK: tl.constexpr = 1
    if K_CONTIG:
        prefetch_l2(ptr, o0, O, o_count, ld * EB, (k0 // PACK) * EB, (BK // PACK) * EB,
                    ((K + PACK - 1) // PACK) * EB)
    else:
        prefetch_l2(ptr, k0, BK, K, ld * EB, (o0 // PACK) * EB, (O // PACK) * EB,
                    ((o_count + PACK - 1) // PACK) * EB)
