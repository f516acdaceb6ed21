"""The README's first examples run as written (on the CPU here): the code blocks of its "Using it"
section before the GPU examples are extracted and each runs on its own, in a fresh namespace, as a
user pasting one of them into a new session would."""

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.transformers

README = Path(__file__).resolve().parents[1] / "README.md"


def cpu_examples() -> list[str]:
    text = README.read_text()
    section = text.split("\n## Using it\n", 1)[1].split("\n### On a GPU", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_cpu_examples_run(tmp_path, monkeypatch):
    blocks = cpu_examples()
    assert len(blocks) == 2, "the tensors example, then the tiny model quantized, saved and loaded"
    assert "from_pretrained" in blocks[1] and "save_pretrained" in blocks[1]
    monkeypatch.chdir(tmp_path)  # the model example saves a checkpoint under the working directory
    namespaces, printed = [], []
    for i, code in enumerate(blocks):
        namespace: dict = {"__name__": "__readme__"}  # each example on its own: no names carried over
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md example {i + 1}", "exec"), namespace)
        namespaces.append(namespace)
        printed.append(out.getvalue())
    assert "lowering" in printed[0]  # tileq.explain's plan
    y = namespaces[0]["y"]
    assert y.shape == (16, 1024) and y.dtype.is_floating_point
    assert "14 layers converted, 1 left unquantized" in printed[1]
    assert (tmp_path / "tiny-a8w8" / "config.json").is_file()
    assert type(namespaces[1]["model"]).__name__ == "Qwen3ForCausalLM"
    assert re.search(r"tensor\(\[\[ *1, *2, *3(, *\d+){5}\]\]", printed[1])  # 5 generated tokens
