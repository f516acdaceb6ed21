"""The README's first examples run as written (on the CPU here): the code blocks of its "Using it"
section before the GPU examples are extracted and run in order, in one namespace, as a user
pasting them into one session would."""

import contextlib
import io
import re
from pathlib import Path

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
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(blocks):
            exec(compile(code, f"README.md example {i + 1}", "exec"), namespace)
    printed = out.getvalue()
    assert "lowering" in printed  # tileq.explain's plan
    assert "14 layers converted, 1 left unquantized" in printed
    assert (tmp_path / "tiny-a8w8" / "config.json").is_file()
    y = namespace["y"]
    assert y.shape == (16, 1024) and y.dtype.is_floating_point
    assert type(namespace["model"]).__name__ == "Qwen3ForCausalLM"
    assert re.search(r"tensor\(\[\[ *1, *2, *3(, *\d+){5}\]\]", printed)  # 5 generated tokens
