"""kernels/select.py: the one place that decides orientation, int4 load path and K masking."""

from tileq.kernels.config import TileConfig, smem_estimate
from tileq.catalog.families import family_spec
from tileq.catalog.names import parse_family
from tileq.dtypes import OperandType as T
from tileq.kernels.launch import signature, specialization
from tileq.kernels.select import kernel_notes, orientation, triton_kernel
from tileq.problem import ScaleKind


def test_orientation_swaps_operands_layouts_and_scales():
    spec = family_spec(parse_family("bquant_fp8xi4_rcr_decode"), 1, 4096, 4096)
    direct = orientation(spec, False)
    assert (direct.a_type, direct.b_type, direct.a_layout, direct.b_layout) == (T.FP8, T.I4, "r", "c")
    swapped = orientation(spec, True)
    assert (swapped.a_type, swapped.b_type, swapped.a_layout, swapped.b_layout) == (T.I4, T.FP8, "r", "c")
    assert (swapped.a_scale, swapped.b_scale) == (spec.b_scale_kind, spec.a_scale_kind)
    assert swapped.b_scale is ScaleKind.VECTOR and swapped.a_scale is ScaleKind.GROUP


def test_launcher_build_and_smem_read_the_same_choice():
    spec = family_spec(parse_family("bquant_fp8xi4_rcr_decode"), 1, 4096, 4100)
    for cfg in (TileConfig(16, 64, 128, 4, 4), TileConfig(64, 16, 128, 4, 4, swap_ab=True)):
        tk = triton_kernel(spec, cfg)
        consts = specialization(spec, cfg)
        o = tk.orientation
        assert (consts["A_TYPE"], consts["B_TYPE"], consts["SWAPPED"]) == (o.a_type.value, o.b_type.value, o.swapped)
        assert consts["EVEN_K"] is tk.even_k is False  # 4100 % 128 != 0
        assert consts["I4_WORDS"] is tk.i4_words
        sig, _, _ = signature(spec, cfg)
        assert sig["a_ptr"] == ("*u8" if cfg.swap_ab else "*fp8e4nv")
        # The int4 tile is the kernel's A tile when swapped: half a byte per element.
        a_bytes = cfg.block_m * cfg.block_k * (0.5 if cfg.swap_ab else 1.0)
        b_bytes = cfg.block_n * cfg.block_k * (1.0 if cfg.swap_ab else 0.5)
        converted = cfg.block_k * (cfg.block_m if cfg.swap_ab else cfg.block_n)  # int4 -> fp8 copy
        assert smem_estimate(spec, cfg) == int((a_bytes + b_bytes) * cfg.num_stages + converted)
        notes = kernel_notes(spec, cfg)
        assert notes[0].startswith("swapped" if cfg.swap_ab else "direct")
        assert notes[-1] == "last K tile masked"
