"""``QuantExperts``: a mixture-of-experts layer's routed experts stored quantized, as tileq's grouped
GEMMs read them, and run by ``tileq.moe.fused_moe``.

Stored tensors (all buffers, all in ``state_dict``; E experts, hidden size H, intermediate size I):

    gate_up_proj        [E, 2I, H] int8 | float8_e4m3fn, or uint8 [E, 2I, H // 2] for int4 (pk_int4:
                        pairs along H, element 2j in the high nibble, value = nibble - 8); rows
                        0..I-1 of each expert are the gate projection, I..2I-1 the up projection
                        (transformers' ``gate_up_proj`` layout: each expert an nn.Linear weight)
    gate_up_proj_scale  float32 [E, 2I] per output channel, or [E, Gn, Gk] for groups (the grouped
                        GEMM's weight orientation: Gk = ceil(H / group_k), Gn = 2I or ceil(2I / 128))
    down_proj           [E, H, I] (uint8 [E, H, I // 2] for int4)
    down_proj_scale     float32 [E, H] or [E, Gn, Gk] (Gk = ceil(I / group_k))

The values are ``tileq.quant.quantize_weight`` of each expert's [N, K] weight; a group scale is that
function's [Gk, Gn] transposed. ``forward(hidden_states, top_k_index, top_k_weights)`` has the
signature of transformers' experts modules, so a QuantExperts can stand where one stood.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DTypeError, ShapeError, UnsupportedError, expect
from ..nn.configs import QuantConfig
from ..quant import quantize_weight
from .layer import fused_moe
from .spec import ExpertsSpec

_WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
_DTYPES = (torch.bfloat16, torch.float16)


def _refusal(config: QuantConfig, e: int, h: int, i: int) -> str | None:
    if min(e, h, i) < 1:
        return f"empty experts (E={e}, H={h}, I={i})"
    if config.weight_dtype == "int4" and (h % 2 or i % 2):
        return f"H={h} and I={i} must be even: int4 packs pairs along K"
    return None


class QuantExperts(nn.Module):
    """E routed experts (gate_up then SiLU·mul then down), weights quantized with ``config``."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *, config: QuantConfig,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if not isinstance(config, QuantConfig):
            raise UnsupportedError(expect("config", "a tileq quantization config (e.g. tileq.A8W8Config())",
                                          type(config).__name__))
        for arg, v in (("num_experts", num_experts), ("hidden_dim", hidden_dim),
                       ("intermediate_dim", intermediate_dim)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ShapeError(expect(arg, "an int", repr(v)))
        why = _refusal(config, num_experts, hidden_dim, intermediate_dim)
        if why is not None:
            raise UnsupportedError(expect("config", f"experts {config.name} can serve", why))
        if dtype not in _DTYPES:
            raise DTypeError(expect("dtype", "torch.bfloat16 or torch.float16", dtype))
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.quant_config, self.dtype = config, dtype
        self.spec = ExpertsSpec.of(config, num_experts, hidden_dim, intermediate_dim)
        for name, shape, dt in self._layout():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device=device))

    def _layout(self):
        """(name, shape, dtype) of every stored tensor."""
        e, h, i, s = self.num_experts, self.hidden_dim, self.intermediate_dim, self.spec
        wdt = _WEIGHT_DTYPES[s.weight_dtype]
        pack = 2 if s.weight_dtype == "int4" else 1
        return (("gate_up_proj", (e, 2 * i, h // pack), wdt),
                ("gate_up_proj_scale", s.scale_shape(2 * i, h), torch.float32),
                ("down_proj", (e, h, i // pack), wdt),
                ("down_proj_scale", s.scale_shape(h, i), torch.float32))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_weights(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, config: QuantConfig
                     ) -> QuantExperts:
        """Quantize unquantized expert weights: gate_up_proj [E, 2I, H] and down_proj [E, H, I], each
        expert an nn.Linear weight (transformers' layout), with ``config`` on their device."""
        for arg, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3:
                raise ShapeError(expect(arg, "a 3-D tensor [E, N, K]", getattr(w, "shape", type(w).__name__)))
            if not w.dtype.is_floating_point:
                raise DTypeError(expect(arg, "a floating-point weight", w.dtype))
            if w.device.type == "meta":
                raise UnsupportedError(expect(arg, "a weight with data", "a meta tensor"))
        e, i2, h = gate_up_proj.shape
        if i2 % 2 or tuple(down_proj.shape) != (e, h, i2 // 2):
            raise ShapeError(expect("down_proj", f"shape [E, H, I] = {(e, h, i2 // 2)} for gate_up_proj "
                                    f"{tuple(gate_up_proj.shape)} = [E, 2I, H]", tuple(down_proj.shape)))
        dtype = gate_up_proj.dtype if gate_up_proj.dtype in _DTYPES else torch.bfloat16
        mod = cls(e, h, i2 // 2, config=config, dtype=dtype, device=gate_up_proj.device)
        for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            mod._buffers[name], mod._buffers[name + "_scale"] = mod.quantize_stacked(w)
        return mod

    @classmethod
    def from_experts(cls, module: nn.Module, config: QuantConfig) -> QuantExperts:
        """Quantize a transformers experts module (``Qwen3MoeExperts``, ``MixtralExperts``,
        ``DeepseekV3Experts``, ...: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I],
        concatenated gate/up, no bias, SiLU). Raises UnsupportedError naming what differs."""
        why = experts_refusal(module)
        if why is not None:
            raise UnsupportedError(expect("module", "a transformers experts module tileq can run", why))
        return cls.from_weights(module.gate_up_proj, module.down_proj, config)

    def quantize_stacked(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, scales) of E stacked nn.Linear weights [E, N, K] quantized with this module's
        config, expert by expert, in the layout of its buffers."""
        qs, ss = zip(*(self._quantize(w[x].detach()) for x in range(w.shape[0])))
        return torch.stack(qs), torch.stack(ss)

    def _quantize(self, w: torch.Tensor):
        c = self.quant_config
        q, s = quantize_weight(w, c.weight_dtype, granularity=c.weight_granularity, group_k=c.group_k,
                               group_n=c.group_n, clip_search=c.weight_dtype == "int4")
        q = q.data if c.weight_dtype == "int4" else q
        return q.contiguous(), (s.t() if s.dim() == 2 else s).contiguous()  # [Gk, Gn] -> [Gn, Gk]

    # ------------------------------------------------------------------ state dict

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Exact dtypes and shapes: torch's default load would cast fp8 into int8 without a word.
        for name, shape, dt in self._layout():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            t = state_dict[key]
            if not isinstance(t, torch.Tensor) or t.dtype != dt:
                raise DTypeError(expect(key, f"dtype {dt} for {self.quant_config.name} experts",
                                        getattr(t, "dtype", type(t).__name__)))
            if tuple(t.shape) != shape:
                raise ShapeError(expect(key, f"shape {shape}", tuple(t.shape)))
            self._buffers[name] = t.to(self._buffers[name].device).contiguous()

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) moves the experts but never casts the quantized weights or the
        # fp32 scales; a float cast changes the compute dtype (the experts follow their model).
        cast = fn(torch.empty(0, dtype=self.dtype, device=self.gate_up_proj.device)).dtype
        if cast != self.dtype and cast in _DTYPES:
            self.dtype = cast
        for name, buf in list(self._buffers.items()):
            probe = fn(torch.empty(0, dtype=buf.dtype, device=buf.device))
            if probe.device != buf.device:
                self._buffers[name] = buf.to(device=probe.device)
        if recurse:
            for child in self.children():
                child._apply(fn)
        return self

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t]), [T, H]."""
        return fused_moe(hidden_states, (top_k_index, top_k_weights), self)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, {self.quant_config.describe()}")


def experts_refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not an experts module tileq can convert (None when it is)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        return "no 3-D gate_up_proj and down_proj weights"
    # has_post_expert_norm (a norm after each expert) and _is_expert_parallel: transformers 5.25's
    for attr, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                       ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
        if getattr(module, attr, want) != want:
            return (f"{attr}={getattr(module, attr)} (tileq runs concatenated gate/up, [E, N, K] weights, no bias, "
                    "no norm after the experts, every expert on this process)")
    act = getattr(module, "act_fn", None)
    if not (type(act) is nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                     and type(act).__module__ == "transformers.activations")):
        return f"activation {type(act).__name__} (tileq's experts compute SiLU)"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"a custom gate ({type(module).__name__}._apply_gate)"
    e, i2, h = gu.shape
    if i2 % 2 or tuple(down.shape) != (e, h, i2 // 2):
        return f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
    if gu.device.type == "meta":
        return "weights on the meta device (no data to quantize)"
    return None
