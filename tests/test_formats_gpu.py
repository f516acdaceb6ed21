"""Checkpoints on a GPU without the producing libraries (the GPU machine has no compressed-tensors):
a Qwen3-shaped model quantized by tileq, saved by tileq.save_pretrained in compressed-tensors'
format, loaded by tileq.from_pretrained onto the GPU, compared with the same checkpoint on the CPU
(the torch reference executor: every layer on the inputs it sees there, and the logits), then
generating. Skipped without CUDA."""

import pytest
import torch

import formats_artefacts as fa
import tileq
from tileq.nn import QuantLinear, config_from_name

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = [
    pytest.mark.transformers,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOKENS = torch.tensor([[1, 5, 7, 9, 200, 300, 17, 999], [3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.mark.parametrize("name", ["A8W8", "FP8Block", "W4A16", "W4A8"])
def test_saved_qwen3_shaped_checkpoint_loads_on_gpu_and_generates(name, tmp_path):
    torch.manual_seed(7)
    cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                                   vocab_size=1024, max_position_embeddings=256)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        dense = model(TOKENS).logits.float()
    config = config_from_name(name)
    tileq.quantize_(model, config)
    fmt = tileq.save_pretrained(model, tmp_path / name)
    gpu = tileq.from_pretrained(tmp_path / name, device="cuda")
    cpu = tileq.from_pretrained(tmp_path / name)
    layers = [m for m in gpu.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(m.weight.is_cuda for m in layers), fmt
    fa.check_gpu_against_cpu(gpu, cpu, dense, act_quantized=config.act_dtype is not None, tokens=TOKENS)
    out = gpu.generate(TOKENS[:1].cuda(), max_new_tokens=8, do_sample=False)
    assert out.shape == (1, TOKENS.shape[1] + 8)
