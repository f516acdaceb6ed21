"""The GPU-only branches of the int4 conversions, checked on CPU.

Triton's interpreter runs each kernel's ``INTERPRETED`` branch, so a wrong constant in a branch
only a GPU compiles leaves every CPU test green. These tests execute the GPU code itself, in
numpy / torch on CPU, against the plain decoding:

- ``gemm_kernel._nibbles_to`` (the portable kernel's int4 unpacking, every compute type): its
  sm_90 TTIR (``triton.compile`` for GPUTarget("cuda", 90, 32) with INTERPRETED false) run by a
  small TTIR emulator for the 16 nibbles;
- the inline PTX of the prepacked int4 kernel (``int4p.kernel._CVT_BF16`` / ``_CVT_FP16``) and of
  the Gluon prefill kernel (``int4p.prefill_kernel.asm_for``, which no interpreter runs at all), run
  by a small PTX emulator over random 32-bit words and over ``prepack_int4``'s words.

Other GPU-only branches under src/tileq/kernels (grep INTERPRET), none with constants of its own:
gemm_kernel's ``_convert`` and ``_dot`` (the grouped kernel's too), int4p/kernel's ``_x_slice`` and
``_dot``, decode_attention's ``_dot`` (fp32 operands in the interpreter, 16-bit ones on the GPU);
act_quant_kernel's ``_to_f32``, ``_round_to``, ``_abs_max``, ``_encode`` (fp8 by cvt) and ``_divide``
(Markstein's division, emulated in tests/test_act_quant.py); qk_rope's ``_mul`` / ``_add`` (one
``mul.rn.f32`` / ``add.rn.f32`` each) and the prefill kernel's ``fma.rn.f32``.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tileq.kernels.int4p import kernel as i4p
from tileq.kernels.int4p import prefill_kernel as pk
from tileq.prepacked import prepack_int4

ROOT = Path(__file__).resolve().parents[1]
NIBBLES = np.arange(16)
VALUES = NIBBLES - 8  # what every conversion must give: nibble - 8, exactly


# ---------------------------------------------------------------------------------- TTIR

# A kernel around _nibbles_to, compiled for sm_90 in a fresh interpreter: this process runs
# Triton in interpreter mode, whose @triton.jit functions cannot be compiled.
_COMPILE = '''
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from tileq.kernels.gemm_kernel import _nibbles_to


@triton.jit
def nibbles(n_ptr, v_ptr, CT: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(v_ptr + i, _nibbles_to(tl.load(n_ptr + i), CT, False).to(tl.float32))


out = {}
for ct in sys.argv[1:]:
    src = triton.compiler.ASTSource(fn=nibbles, signature={"n_ptr": "*u8", "v_ptr": "*fp32", "CT": "constexpr"},
                                    constexprs={"CT": ct})
    out[ct] = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
print(json.dumps(out))
'''

# _nibbles_to's compute types and the TTIR element type each returns
COMPUTE_TYPES = {"bf16": "bf16", "fp16": "f16", "bf8": "f8E5M2", "fp8": "f8E4M3FN", "i8": "i8"}
_TORCH = {"i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "bf16": torch.bfloat16, "f16": torch.float16,
          "f32": torch.float32, "f8E5M2": torch.float8_e5m2, "f8E4M3FN": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def ttir(tmp_path_factory):
    script = tmp_path_factory.mktemp("ttir") / "compile_nibbles.py"  # @triton.jit reads its source file
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, str(script), *COMPUTE_TYPES], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _elem(ty: str) -> str:
    m = re.fullmatch(r"tensor<\d+x(\w+)>", ty.strip())
    assert m, ty
    return m.group(1)


def run_ttir(text: str, nibbles: np.ndarray) -> tuple[torch.Tensor, str]:
    """Run the kernel body of ``text`` with ``nibbles`` as its one load: (the stored tensor, the
    element type of the value converted to fp32 for the store, i.e. _nibbles_to's result type).
    Pointer arithmetic is skipped; any other op not emulated here fails the test."""
    vals: dict[str, tuple[torch.Tensor | None, str]] = {}
    stored = None
    for line in text.splitlines():
        line = re.sub(r"\s+loc\(.*\)\s*$", "", line.strip())
        m = re.fullmatch(r"(?:(%[\w.]+) = )?([\w.]+)\s*(.*)", line)
        if not m or not m.group(2).startswith(("arith.", "tt.")) or m.group(2) in ("tt.func", "tt.return"):
            continue
        dest, op, rest = m.groups()
        args, _, types = rest.partition(" : ")
        ops = [vals.get(a.strip(), (None, ""))[0] for a in args.split(",") if a.strip().startswith("%")]
        if op == "arith.constant":
            value = re.fullmatch(r"dense<(.+)>", args.strip()).group(1)
            ty = _elem(types)
            num = float(value) if ty[0] in "bf" else int(value, 0)
            vals[dest] = (torch.full((16,), num, dtype=_TORCH[ty]), ty)
        elif op in ("tt.make_range", "tt.splat", "tt.addptr"):
            vals[dest] = (None, "ptr")
        elif op == "tt.load":
            vals[dest] = (torch.from_numpy(nibbles.astype(np.uint8)).view(torch.int8), "i8")
        elif op == "tt.store":
            stored = ops[1]
        elif op in ("arith.extui", "arith.trunci", "arith.extf", "arith.sitofp", "tt.bitcast", "tt.fp_to_fp"):
            src_ty, dst_ty = (_elem(t) for t in re.split(r" to | -> ", types))
            x = ops[0]
            if op == "arith.extui":
                y = x.to(_TORCH[dst_ty]) & ((1 << (8 * x.element_size())) - 1)
            elif op == "tt.bitcast":
                y = x.view(_TORCH[dst_ty])
            else:  # trunci wraps; extf, sitofp, fp_to_fp (rtne) round as torch does on CPU
                y = x.to(_TORCH[dst_ty])
            vals[dest] = (y, dst_ty)
            if dst_ty == "f32":
                result_type = src_ty
        elif op in ("arith.ori", "arith.andi", "arith.subi", "arith.addi", "arith.shrui", "arith.subf", "arith.addf",
                    "arith.mulf"):
            a, b = ops
            ty = _elem(types)
            if op == "arith.shrui":  # logical: shift the unsigned bits
                bits = 8 * a.element_size()
                y = ((a.to(torch.int64) & ((1 << bits) - 1)) >> b.to(torch.int64)).to(a.dtype)
            else:
                y = {"arith.ori": torch.bitwise_or, "arith.andi": torch.bitwise_and, "arith.subi": torch.sub,
                     "arith.addi": torch.add, "arith.subf": torch.sub, "arith.addf": torch.add,
                     "arith.mulf": torch.mul}[op](a, b)
            vals[dest] = (y, ty)
        else:
            raise AssertionError(f"TTIR op {op} is not emulated here (extend run_ttir): {line}")
    assert stored is not None, "no store found"
    return stored, result_type


@pytest.mark.parametrize("ct", list(COMPUTE_TYPES))
def test_nibbles_to_gpu_branch_gives_nibble_minus_8(ttir, ct):
    """Every nibble through _nibbles_to's sm_90 code equals nibble - 8 in the compute type."""
    got, result_type = run_ttir(ttir[ct], NIBBLES)
    assert result_type == COMPUTE_TYPES[ct]
    assert got.dtype == torch.float32 and got.tolist() == VALUES.tolist(), (ct, got.tolist())


@pytest.mark.parametrize("ct", ["bf16", "fp16", "bf8", "fp8"])
def test_nibbles_to_gpu_branch_has_no_int_to_float_conversion(ttir, ct):
    """The reason for the magic-number branch: no I2F (quarter rate on sm_90) in the 16-bit and
    8-bit float conversions; the harness's own conversion to fp32 is a float extension."""
    assert "itofp" not in ttir[ct], ttir[ct]


def test_ttir_emulator_rejects_unknown_ops_and_catches_a_wrong_constant(ttir):
    """The emulator reads the constants from the TTIR: 0x4301 for 0x4300 (bf16 128.0) changes the
    even nibbles' values; an op it does not know fails instead of being skipped."""
    wrong, _ = run_ttir(ttir["bf16"].replace("dense<17152>", "dense<17153>", 1), NIBBLES)
    assert wrong.tolist() != VALUES.tolist()
    with pytest.raises(AssertionError, match="arith.xori is not emulated"):
        run_ttir(ttir["bf16"].replace("arith.ori", "arith.xori", 1), NIBBLES)


# ---------------------------------------------------------------------------------- PTX

_MASK = np.uint64(0xFFFFFFFF)


def _lop3(a, b, c, lut: int):
    """PTX lop3.b32: bit i of the result is bit (4 a_i + 2 b_i + c_i) of lut."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            term = (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            out |= term & _MASK
    return out & _MASK


def _halves(x, ty: str) -> torch.Tensor:
    """The two 16-bit lanes of 32-bit registers ``x`` as [2, n] of ``ty`` (lane 0: bits 0-15)."""
    lanes = np.stack([x & np.uint64(0xFFFF), x >> np.uint64(16)]).astype(np.uint16)
    return torch.from_numpy(lanes.view(np.int16)).view(ty)


def _join(h: torch.Tensor) -> np.ndarray:
    lanes = h.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)
    return lanes[0] | lanes[1] << np.uint64(16)


def _operands(text: str) -> list[str]:
    """Comma-separated operands, a braced vector ``{a, b}`` kept whole."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the PTX of an inline-asm string on 32-bit registers (uint64 arrays holding 32 bits;
    16-bit registers hold 16). ``inputs``: "$8" -> words. Returns every register. Only the
    instructions below are known: any other fails the test."""
    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}", asm
    regs = {k: v.astype(np.uint64) & _MASK for k, v in inputs.items()}

    def val(x: str) -> np.ndarray:
        if x.startswith("{"):  # a vector of two 16-bit registers, the first in the low half
            lo, hi = (val(p) for p in _operands(x[1:-1]))
            return lo | hi << np.uint64(16)
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", x):
            return np.uint64(int(x, 0))
        return regs[x]

    for stmt in body[1:-1].split(";"):
        stmt = " ".join(stmt.split())
        if not stmt or stmt.startswith(".reg "):
            continue
        op, _, rest = stmt.partition(" ")
        d, *src = _operands(rest)
        if op == "mov.b32":
            out = val(src[0]) & _MASK
        elif op == "shr.u32":
            out = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            out = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif m := re.fullmatch(r"(sub|mul\.rn)\.(bf16|f16)x2", op):
            ty = torch.bfloat16 if m.group(2) == "bf16" else torch.float16
            a, b = _halves(val(src[0]), ty), _halves(np.broadcast_to(val(src[1]), regs[src[0]].shape), ty)
            out = _join(a - b if m.group(1) == "sub" else a * b)  # torch on CPU: one rounding, to nearest even
        elif op == "cvt.rn.satfinite.e4m3x2.f16x2":  # each f16 lane -> its e4m3 byte, lane 0 the low byte
            f8 = _halves(val(src[0]), torch.float16).to(torch.float8_e4m3fn)
            b = f8.view(torch.uint8).numpy().astype(np.uint64)
            out = b[0] | b[1] << np.uint64(8)
        else:
            raise AssertionError(f"PTX instruction {op} is not emulated here (extend run_ptx): {stmt}")
        regs[d] = out
    return regs


def _lane_values(reg: np.ndarray, ty) -> np.ndarray:
    """[2, n] float values of a register's two 16-bit lanes."""
    return _halves(reg, ty).float().numpy()


def _words(n: int, seed: int) -> np.ndarray:
    words = np.random.default_rng(seed).integers(0, 1 << 32, size=n, dtype=np.uint64)
    words[:3] = [0, 0xFFFFFFFF, 0x88888888]  # every nibble 0, 15, 8
    return words


CVT = {"bf16": (i4p._CVT_BF16, torch.bfloat16), "fp16": (i4p._CVT_FP16, torch.float16)}


@pytest.mark.parametrize("ct", list(CVT))
def test_int4p_cvt_asm_on_random_words(ct):
    """_CVT_* on random word pairs ($8 = word c, $9 = word c + 1): register q (0..7), lane h holds
    nibble 4 (q % 4) + 4 h of word q // 4, minus 8 -- the interpreter branch of _slices."""
    asm, ty = CVT[ct]
    w = [_words(4096, 1), _words(4096, 2)]
    regs = run_ptx(asm.value, {"$8": w[0], "$9": w[1]})
    for q in range(8):
        got = _lane_values(regs[f"${q}"], ty)
        for h in range(2):
            want = ((w[q // 4] >> np.uint64(4 * (q % 4) + 16 * h)) & np.uint64(15)).astype(np.int64) - 8
            np.testing.assert_array_equal(got[h], want, err_msg=f"{ct} register {q} lane {h}")


@pytest.mark.parametrize("ct", list(CVT))
def test_int4p_cvt_asm_through_prepack(ct):
    """prepack_int4's words through _CVT_*: register s, lane h of the pair (c, c + 1), c even, of
    block b is the weight at k = 512 b + 64 s + c + h (the kernel's slice s, column c + h)."""
    asm, ty = CVT[ct]
    gen = torch.Generator().manual_seed(3)
    v = torch.randint(-8, 8, (16, 1024), generator=gen, dtype=torch.int8)
    words = prepack_int4(v).data.numpy().view(np.uint32).astype(np.uint64)  # [16, 128]
    seen = 0
    for b in range(2):
        for c in range(0, 64, 2):
            regs = run_ptx(asm.value, {"$8": words[:, 64 * b + c], "$9": words[:, 64 * b + c + 1]})
            for s in range(8):
                got = _lane_values(regs[f"${s}"], ty)
                for h in range(2):
                    np.testing.assert_array_equal(got[h], v[:, 512 * b + 64 * s + c + h].numpy())
                    seen += 1
    assert seen == 2 * 32 * 16


def test_ptx_emulator_catches_a_wrong_constant():
    """The emulator runs the string's constants: 0x4301 for 0x4300 in the bf16 string's lop3
    changes the even nibbles; an unknown instruction fails."""
    asm = i4p._CVT_BF16.value
    assert asm.count("0x43004300") == 8
    w = _words(64, 4)
    regs = run_ptx(asm.replace("0x43004300", "0x43014301"), {"$8": w, "$9": w})
    want = ((w & np.uint64(15)).astype(np.int64) - 8)
    assert not np.array_equal(_lane_values(regs["$0"], torch.bfloat16)[0], want)
    with pytest.raises(AssertionError, match="and.b32 is not emulated"):
        run_ptx(asm.replace("shr.u32 a1", "and.b32 a1", 1), {"$8": w, "$9": w})


# The Gluon prefill kernel: slice i (0..3) of a 512 block, k in [128 i, 128 i + 128), made by asm_for
# from the words of one thread: 16-bit types from a pair (c, c + 1), c even, fp8 from a quad
# (c .. c + 3), c a multiple of 4. Output j (0, 1), lane / byte t holds k = 128 i + 64 j + c + t.


def _prefill_words(seed: int):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(-8, 8, (8, 512), generator=gen, dtype=torch.int8)
    return v, prepack_int4(v).data.numpy().view(np.uint32).astype(np.uint64)  # [8, 64]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("ct", ["bf16", "fp16"])
def test_prefill_asm_16bit_through_prepack(ct, scaled):
    """asm_for(ct, i, scaled): the weights at k = 128 i + 64 j + c + h, times the row's 16-bit
    scale ($4, both lanes) rounded once where scaled."""
    ty = torch.bfloat16 if ct == "bf16" else torch.float16
    v, words = _prefill_words(5)
    scale = torch.linspace(0.0123, 0.2, 8).to(ty)  # one per row
    s_bits = scale.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)
    for i in range(4):
        asm = pk.asm_for(ct, i, scaled)
        for c in range(0, 64, 2):
            regs = run_ptx(asm, {"$2": words[:, c], "$3": words[:, c + 1], "$4": s_bits | s_bits << np.uint64(16)})
            for j in range(2):
                got = _halves(regs[f"${j}"], ty)
                for h in range(2):
                    want = v[:, 128 * i + 64 * j + c + h].to(ty)
                    if scaled:
                        want = want * scale
                    assert torch.equal(got[h], want), (ct, scaled, i, c, j, h)


def test_prefill_asm_fp8_through_prepack():
    """asm_for('fp8', i): four e4m3 bytes per output, byte t the weight at k = 128 i + 64 j + c + t."""
    v, words = _prefill_words(6)
    for i in range(4):
        asm = pk.asm_for("fp8", i, False)
        for c in range(0, 64, 4):
            regs = run_ptx(asm, {f"${2 + t}": words[:, c + t] for t in range(4)})
            for j in range(2):
                for t in range(4):
                    byte = ((regs[f"${j}"] >> np.uint64(8 * t)) & np.uint64(0xFF)).astype(np.uint8)
                    got = torch.from_numpy(byte).view(torch.float8_e4m3fn).float()
                    assert torch.equal(got, v[:, 128 * i + 64 * j + c + t].float()), (i, c, j, t)
