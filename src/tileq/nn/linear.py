"""``QuantLinear``: an nn.Linear whose weight is stored quantized and whose forward quantizes the
activation and runs one tileq GEMM with the dequantization and the bias fused.

Stored tensors (all buffers, all in ``state_dict``):

    weight        int8 [N, K] | float8_e4m3fn [N, K] | uint8 [N, K // 2] for int4 (tileq's pk_int4:
                  pairs along K, element 2j in the high nibble, value = nibble - 8); int4 layers
                  of a config with int4_layout='prepacked' (the default) hold int32 words in the
                  i4p1 layout instead (tileq.prepacked) and write pk_int4 to state dicts
    weight_scale  float32, the b_scale contract's shape for the logical B = weight.t():
                  [N] per channel; [Gk, Gn] for groups (Gn = N for groups along K only)
    bias          float32 [N] or None (fp32 so the GEMM reads it without a cast per call)
    input_scale   float32 0-d static activation scale, or None (dynamic, per call)

The forward call never synchronizes with the host and allocates only its outputs (the quantized
activation, its scale and the result), so it can be captured in a CUDA graph. Eagerly it calls the
launchers directly (the host cost of a dispatcher round trip per layer is what an eager decode
spends its time on); under ``torch.compile`` it goes through the ``tileq::`` custom ops
(``tileq.ops``), which run the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import settings
from ..dtypes import PackedInt4
from ..prepacked import PrepackedInt4, prepack_int4, unprepack_int4
from ..errors import DTypeError, ShapeError, TileqError, UnsupportedError, expect
from ..api import linear, linear_call
from ..quant import quantize_weight
from ..tracing import layer_tile_counters
from .configs import QuantConfig, weight_scale_shape
from ..quant_linear import (LayerRunner, LayerSpec, keeps_launches, learn, quant_linear_forward, runner_key,
                            weight_operand)

# Eager fast path bookkeeping: call signatures kept per layer (quant_linear.learn marks a signature
# seen once, builds its runner on its second call, or marks it for the plain path).
MAX_RUNNERS = 64

_WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantLinear(nn.Module):
    """A quantized ``nn.Linear`` (y = x @ W.t() + b) running on tileq's fused GEMMs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, config: QuantConfig,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if not isinstance(config, QuantConfig):
            raise UnsupportedError(expect("config", "a tileq quantization config (e.g. tileq.A8W8Config())",
                                          type(config).__name__))
        for arg, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ShapeError(expect(arg, "an int", repr(v)))
        why = config.cannot_serve(in_features, out_features)
        if why is not None:
            raise UnsupportedError(expect("config", f"a layer {config.name} can serve", why))
        if dtype not in _OUT_DTYPES:
            raise DTypeError(expect("dtype", "torch.bfloat16, torch.float16 or torch.float32", dtype))
        self.in_features, self.out_features, self.config, self.dtype = in_features, out_features, config, dtype
        self.register_buffer("weight", torch.empty(self.weight_shape, dtype=self.weight_dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(weight_scale_shape(config, out_features, in_features),
                                                         dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("input_scale", None)
        # The tile counters of its split GEMMs under torch.compile (not saved: zeros).
        self.register_buffer("tile_counters", layer_tile_counters(out_features, device), persistent=False)
        self.spec = LayerSpec.of(config, in_features, out_features)
        self._w4: PackedInt4 | None = None
        self._runners: dict = {}  # eager fast path: one LayerRunner per call signature

    # ------------------------------------------------------------------ construction

    @property
    def weight_dtype(self) -> torch.dtype:
        return _WEIGHT_DTYPES[self.config.weight_dtype]

    @property
    def weight_shape(self) -> tuple:
        k = self.in_features // 2 if self.config.weight_dtype == "int4" else self.in_features
        return (self.out_features, k)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, *, hessian: torch.Tensor | None = None
                    ) -> "QuantLinear":
        """Quantize ``linear``'s weight (on its device) with ``config``; the bias is kept in fp32.

        ``hessian`` (int4 configs): H = 2 X^T X of the layer's calibration inputs [K, K]; the
        weight is then rounded with GPTQ (``tileq.nn.gptq``) instead of to nearest."""
        if not isinstance(linear, nn.Linear):
            raise UnsupportedError(expect("linear", "a torch.nn.Linear", type(linear).__name__))
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_weight(linear.weight.detach(), bias, config, hessian=hessian, where="linear.weight")

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig, *,
                    hessian: torch.Tensor | None = None, where: str = "weight") -> "QuantLinear":
        """``from_linear`` on an nn.Linear weight [N, K] and bias [N] (or None) given as tensors (a
        checkpoint loader quantizing each weight as it is read)."""
        if w.device.type == "meta":
            raise UnsupportedError(expect(where, "a weight with data", "a meta tensor"))
        if not w.dtype.is_floating_point:
            raise DTypeError(expect(where, "a floating-point weight", w.dtype))
        if w.dim() != 2:
            raise ShapeError(expect(where, "a 2-D weight [out_features, in_features]", tuple(w.shape)))
        dtype = w.dtype if w.dtype in _OUT_DTYPES and w.dtype.itemsize >= 2 else torch.bfloat16
        layer = cls(w.shape[1], w.shape[0], bias is not None, config=config, dtype=dtype, device=w.device)
        c = config
        granularity = c.weight_granularity
        if hessian is not None:
            if c.weight_dtype != "int4":
                raise UnsupportedError(expect("hessian", "an int4 config (GPTQ rounds int4 weights)", c.name))
            from ..quant import pack_int4
            from .gptq import gptq_int4

            q, sw = gptq_int4(w, hessian.to(w.device), getattr(c, "group_size", c.group_k))
            qw = pack_int4(q, dim=1)
        else:
            qw, sw = quantize_weight(w, c.weight_dtype, granularity=granularity, group_k=c.group_k,
                                     group_n=c.group_n, clip_search=c.weight_dtype == "int4")
        layer._adopt("weight", qw.data if isinstance(qw, PackedInt4) else qw, "weight")
        layer.weight_scale.copy_(sw.reshape(layer.weight_scale.shape))
        if bias is not None:
            layer.bias.copy_(bias.float())
        return layer

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, *, config: QuantConfig,
                       bias: torch.Tensor | None = None, input_scale=None, in_features: int | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> "QuantLinear":
        """A layer from tensors already in the stored layout above (checked, then taken as is:
        no copy when dtype and device already match). ``in_features`` defaults to weight's K
        (twice its width for int4)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ShapeError(expect("weight", "a 2-D tensor", getattr(weight, "shape", type(weight).__name__)))
        n = weight.shape[0]
        k = in_features if in_features is not None else (
            2 * weight.shape[1] if config.weight_dtype == "int4" else weight.shape[1])
        layer = cls(k, n, bias is not None, config=config, dtype=dtype, device="meta")
        tensors = {"weight": weight, "weight_scale": weight_scale}
        if bias is not None:
            tensors["bias"] = bias
        if input_scale is not None:
            tensors["input_scale"] = input_scale
        for name, t in tensors.items():
            layer._adopt(name, t, name)
        return layer

    def _adopt(self, name: str, t, where: str) -> None:
        """Set buffer ``name`` from ``t`` after checking its dtype and shape exactly."""
        self._w4 = None
        self._runners = {}
        want_shape, want_dtype = self._expected(name)
        if not isinstance(t, torch.Tensor):
            raise DTypeError(expect(where, "a torch.Tensor", type(t).__name__))
        if name in ("bias", "input_scale"):
            if not t.dtype.is_floating_point or t.dtype.itemsize < 2:
                raise DTypeError(expect(where, "a float32/bfloat16/float16 tensor", t.dtype))
            t = t.float()
            if name == "input_scale":
                if t.numel() != 1:
                    raise ShapeError(expect(where, "a one-element static activation scale", tuple(t.shape)))
                t = t.reshape(())
        elif name == "weight" and t.dtype == torch.int32 and self._prepacks():
            # Already prepacked (a merge of prepacked layers): checked by PrepackedInt4.
            self._set_weight(PrepackedInt4(t.contiguous(), (self.out_features, self.in_features)).data)
            return
        elif t.dtype != want_dtype:
            raise DTypeError(expect(where, f"dtype {want_dtype} for {self.config.name}", t.dtype))
        if tuple(t.shape) != want_shape:
            raise ShapeError(expect(where, f"shape {want_shape} for a {self.out_features}x{self.in_features} "
                                           f"{self.config.name} layer", tuple(t.shape)))
        if name == "input_scale" and self.config.act_dtype is None:
            raise UnsupportedError(expect(where, f"no activation scale ({self.config.name} keeps activations "
                                                 "unquantized)", "a static activation scale"))
        t = t.contiguous()
        if name == "weight":
            self._set_weight(prepack_int4(PackedInt4(t, (self.out_features, self.in_features), 1)).data
                             if self._prepacks() else t)
        else:
            self._buffers[name] = t

    def _set_weight(self, t: torch.Tensor) -> None:
        self._buffers["weight"] = t
        if self.tile_counters.device != t.device:  # they follow the weight (a layer built on meta)
            self._buffers["tile_counters"] = layer_tile_counters(self.out_features, t.device)

    def _prepacks(self) -> bool:
        return self.config.weight_dtype == "int4" and self.config.prepacks()

    @property
    def is_prepacked(self) -> bool:
        """True when the int4 weight is held in the prepacked layout (tileq.prepacked, int32 words)."""
        return self.weight is not None and self.weight.dtype == torch.int32

    def set_int4_layout(self, layout: str) -> "QuantLinear":
        """Hold the int4 weight in ``layout`` ('prepacked' or 'pk_int4') from now on: the config
        becomes ``replace(config, int4_layout=layout)`` and the weight is converted exactly."""
        from dataclasses import replace

        from .configs import INT4_LAYOUTS

        if self.config.weight_dtype != "int4":
            raise UnsupportedError(expect("layer", "an int4 layer (W4A16 / W4A8)", self.config.name))
        if layout not in INT4_LAYOUTS:
            raise UnsupportedError(expect("int4_layout", f"one of {INT4_LAYOUTS}", repr(layout)))
        pk = self.packed_weight()
        self.config = replace(self.config, int4_layout=layout)
        self._adopt("weight", pk, "weight")
        return self

    def packed_weight(self) -> torch.Tensor:
        """The weight in its stored interchange form (int4: pk_int4 bytes [N, K / 2], unprepacked
        when the layer holds it prepacked): what state dicts and checkpoints contain."""
        if self.is_prepacked:
            return unprepack_int4(PrepackedInt4(self.weight, (self.out_features, self.in_features))).data
        return self.weight

    def _expected(self, name: str) -> tuple:
        if name == "weight":
            return self.weight_shape, self.weight_dtype
        if name == "weight_scale":
            return weight_scale_shape(self.config, self.out_features, self.in_features), torch.float32
        if name == "bias":
            return (self.out_features,), torch.float32
        if name == "input_scale":
            return (), torch.float32
        raise KeyError(name)

    def set_input_scale(self, scale) -> None:
        """Use a static (calibrated) per-tensor activation scale instead of per-call ones."""
        self._runners = {}
        if scale is None:
            self._buffers["input_scale"] = None
            return
        t = torch.as_tensor(scale, dtype=torch.float32, device=self.weight.device)
        self._adopt("input_scale", t, "input_scale")

    # ------------------------------------------------------------------ state dict

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Strict dtypes and shapes: torch's default load would cast an fp8 weight into an int8
        # buffer (or a bf16 tensor into fp8) without a word.
        for name in ("weight", "weight_scale", "bias", "input_scale"):
            key = prefix + name
            if key in state_dict:
                if name == "bias" and self._buffers.get("bias") is None:
                    unexpected_keys.append(key)
                    continue
                t = state_dict[key]
                dev = self.weight.device
                self._adopt(name, t.to(dev) if dev.type != "meta" else t, key)
            elif name in ("weight", "weight_scale") or (name == "bias" and self._buffers.get("bias") is not None):
                missing_keys.append(key)
            elif name == "input_scale" and self._buffers.get("input_scale") is not None and strict:
                missing_keys.append(key)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.is_prepacked:  # state dicts hold the interchange form (pk_int4)
            destination[prefix + "weight"] = self.packed_weight()

    # ------------------------------------------------------------------ dtype / device moves

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not cast an fp8 weight or the fp32 scales: probe what ``fn``
        # does to an empty tensor of each buffer's dtype and apply only its device move, except
        # that a float cast changes the output dtype (the layer follows its model).
        cast = fn(torch.empty(0, dtype=self.dtype, device=self.weight.device)).dtype
        if cast != self.dtype and cast in _OUT_DTYPES:
            self.dtype = cast
        for name, buf in list(self._buffers.items()):
            if buf is None:
                continue
            probe = fn(torch.empty(0, dtype=buf.dtype, device=buf.device))
            self._buffers[name] = buf.to(device=probe.device) if probe.device != buf.device else buf
        self._w4 = None
        self._runners = {}
        return self

    # ------------------------------------------------------------------ forward

    def weight_operand(self):
        """The stored weight as ``tileq.linear`` takes it (int4: a PackedInt4 over its bytes)."""
        return self._weight_operand()

    def _weight_operand(self):
        if self.config.weight_dtype != "int4":
            return self.weight
        w4 = self._w4
        if w4 is None or w4.data is not self.weight:
            w4 = self._w4 = weight_operand(self.weight, self.spec.int4_k)
        return w4

    def _counters(self) -> torch.Tensor | None:
        """The layer's tile counters where they live with its weight (a layer built on the meta
        device and filled later gets them with its weight, ``_set_weight``)."""
        c = self.tile_counters
        return c if c.device == self.weight.device else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            from ..ops import quant_linear_op

            return quant_linear_op(x, self.weight, self.weight_scale, self.bias, self.input_scale,
                                   self.spec.key, self._counters())
        # Eager: a runner per call signature skips the per-call validation and cache keys of the
        # public functions (host time is what an eager decode spends; see LayerRunner).
        # A runner is built on a signature's second call: building one costs an extra launch or
        # two, which a prefill whose length never repeats should not pay.
        scale = self.input_scale
        key = runner_key(x, scale is not None)
        runner = self._runners.get(key)
        if type(runner) is LayerRunner:
            return runner(x, self.weight, self.weight_scale, self.bias, scale)
        self._check_input(x)
        operand = self._weight_operand()
        y = quant_linear_forward(self.spec, x, operand, self.weight_scale, self.bias, scale)
        learn(self._runners, key, runner, MAX_RUNNERS, keeps_launches(x) and len(self._runners) < MAX_RUNNERS,
              self.spec, x, operand, self.weight_scale, self.bias, scale)
        return y

    def forward_quantized(self, q: torch.Tensor, s: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """The layer's GEMM on an activation already quantized for it (q [..., K] and its scale per
        flattened row, as ``tileq.quantize_activation`` / ``add_rmsnorm_quantize`` return them):
        dequantization, bias and the cast fused. The fused decoder path of
        ``tileq.integrations.hf`` calls it."""
        spec = self.spec
        if torch.compiler.is_compiling():
            from ..ops import linear_op

            return linear_op(q, self.weight, s, self.weight_scale, self.bias, spec.scheme, out_dtype,
                             spec.group_k, spec.group_n, spec.int4_k, self._counters())
        key = ("q", q.shape, q.stride(), q.dtype, q.device, None if s is None else (s.shape, s.stride()),
               out_dtype) + settings.key()  # (the switches the planner read: TILEQ_PDL, TILEQ_BACKEND, ...)
        call = self._runners.get(key)
        if call is not None:
            if q.dim() == 2:
                return call.run(q, self.weight, s, self.weight_scale, self.bias, None, None)
            # q in x's shape ([batch, seq, K], as add_rmsnorm_quantize returns it), s per flattened row
            y = call.run(q.reshape(-1, q.shape[-1]), self.weight, s, self.weight_scale, self.bias, None, None)
            return y.view(*q.shape[:-1], y.shape[-1])
        self._check_input(q)
        y = linear(q, self._weight_operand(), s, self.weight_scale, scheme=spec.scheme, out_dtype=out_dtype,
                   bias=self.bias, group_k=spec.group_k, group_n=spec.group_n)
        if keeps_launches(q) and q.dim() >= 2 and (s is None or s.dim() <= 2) and len(self._runners) < MAX_RUNNERS:
            call = linear_call(q.reshape(-1, q.shape[-1]), self._weight_operand(), s, self.weight_scale,
                               scheme=spec.scheme, out_dtype=out_dtype, bias=self.bias, group_k=spec.group_k,
                               group_n=spec.group_n)
            if call is not None:
                self._runners[key] = call
        return y

    def extra_repr(self) -> str:
        static = ", static activation scale" if self.input_scale is not None else ""
        layout = ", int4 weight prepacked (i4p1)" if self.is_prepacked else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.config.describe()}{static}{layout}")

    # The layer's dotted name in its model (``model.layers.0.mlp.down_proj``), set by quantize_,
    # from_pretrained and fuse_decoder_; errors about the layer's input name it by it.
    qualified_name: str | None = None

    def _check_input(self, x) -> None:
        """A ShapeError naming the layer unless x is [..., in_features] (the plain path runs it
        before the GEMM, whose own message would speak of tileq.linear's x and w)."""
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == self.in_features:
            return
        name = f"QuantLinear {self.qualified_name!r}" if self.qualified_name else repr(self)
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShapeError(expect(f"{name}: input", f"shape [..., in_features] = [..., {self.in_features}]", got))


def quantize_linear_or_reason(linear: nn.Linear, config: QuantConfig, hessian=None
                              ) -> tuple[QuantLinear | None, str]:
    """(layer, "") or (None, why it stays unquantized): quantize_ never stops mid-model."""
    why = config.cannot_serve(linear.in_features, linear.out_features)
    if why is not None:
        return None, why
    if linear.weight.device.type == "meta":
        return None, "weight on the meta device (no data to quantize)"
    try:
        return QuantLinear.from_linear(linear, config, hessian=hessian), ""
    except TileqError as e:
        return None, str(e)
