"""Every repository path the prose names exists: the docs, the READMEs and notes under
bench/results, and the comments and docstrings of the code. A path is a token such as
``scripts/gpu_run.sh``, ``docs/int4.md#...``, ``kernels/direct.py`` (under src/tileq) or
``../<folder>/`` (relative to the file naming it); tokens with placeholders (``<gpu>``, ``*``,
``{...}``) name families of paths and are not checked."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "tileq"

# A path from the repository root, one under src/tileq, or one relative to the naming file.
_ROOTED = r"(?:src/tileq|tests|scripts|docs|bench/results|dev|\.ci)/[\w./<>*{}-]*"
_PACKAGE = r"(?:kernels|dispatch|nn|moe|formats|integrations|distributed|bench|catalog)/[\w/-]+\.(?:py|json)"
_RELATIVE = r"\.\./[\w./<>*{}-]+"
_TOKEN = re.compile(rf"(?<![\w./-])({_ROOTED}|{_PACKAGE}|{_RELATIVE})")
_PLACEHOLDER = re.compile(r"[<>*{}]|\.\.\.")


def _code_prose(text: str) -> str:
    """A Python file's comments and docstrings (its prose), line numbers kept; the rest blanked."""
    lines = text.splitlines()
    keep = [""] * len(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            for i in range(body[0].lineno - 1, body[0].end_lineno):
                keep[i] = lines[i]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0] - 1
            keep[row] = (keep[row] + " " + tok.string).strip()
    return "\n".join(keep)


def prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "bench" / "results").rglob("*.md"))
    files += sorted(p for d in ("src", "tests", "scripts", "dev") for p in (ROOT / d).rglob("*") if p.is_file()
                    and (p.suffix in (".py", ".sh") or p.parent.name == "dev"))
    return [p for p in files if "__pycache__" not in p.parts]


def _exists(token: str, where: Path) -> bool:
    path = token.split("#")[0].rstrip(".,:;)`'\"")
    if not path:
        return True
    candidates = [ROOT / path, where.parent / path]
    if not path.startswith(("src/", "tests/", "scripts/", "docs/", "bench/results", "dev/", ".ci/", "../")):
        candidates.append(PKG / path)
    return any(c.exists() for c in candidates)


def missing_paths() -> list[str]:
    bad = []
    for f in prose_files():
        text = f.read_text(errors="replace")
        if f.suffix == ".py":
            text = _code_prose(text)
        for n, line in enumerate(text.splitlines(), 1):
            for token in _TOKEN.findall(line):
                if _PLACEHOLDER.search(token) or token.endswith("/..."):
                    continue
                if not _exists(token, f):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {token}")
    return bad


def test_every_named_path_exists():
    bad = missing_paths()
    assert not bad, f"{len(bad)} paths named but absent:\n" + "\n".join(bad)


def test_the_check_finds_a_missing_path(tmp_path):
    note = ROOT / "docs" / "performance.md"
    assert _exists("docs/performance.md", note) and _exists("kernels/direct.py", note)
    assert not _exists("scripts/sass_loop.py", note) and not _exists("dispatch/no_such_module.py", note)
    assert _TOKEN.findall("see `scripts/gpu_run.sh` and ../h200/int4/ or kernels/int4p/kernel.py.") == [
        "scripts/gpu_run.sh", "../h200/int4/", "kernels/int4p/kernel.py"]
