"""Kernels and launchers for prepacked int4 weights (``tileq.prepacked``): the Triton decode
kernel, the sm_90 Gluon prefill kernel and its stream-K fix-up, the dequantize kernel."""
