"""Reading and writing safetensors checkpoints, one tensor at a time.

``CheckpointReader`` opens a checkpoint directory (one ``model.safetensors`` or several shards named
by ``model.safetensors.index.json``), answers dtype / shape questions from the headers alone (no
tensor data is read for them) and reads one tensor at a time, moving it to the target device
before the caller asks for the next: host memory holds one tensor (plus the file's mmap), never a
shard or a whole state dict. ``write_checkpoint`` writes a state dict as shards of at most
``max_shard_size`` bytes with the same index format Hugging Face uses.

File-level problems (a missing file, a truncated or corrupt header, an index that names a missing
shard, a tensor named twice) raise ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, expect  # noqa: F401 (CheckpointError re-exported)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype names -> torch dtypes.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the spelling used in error messages)."""
    return str(dtype).removeprefix("torch.")


class TensorInfo:
    """dtype and shape of a stored tensor, read from its file's header."""

    __slots__ = ("name", "dtype", "shape", "file")

    def __init__(self, name: str, dtype: torch.dtype | None, raw_dtype: str, shape, file: Path):
        self.name = name
        self.dtype = dtype if dtype is not None else raw_dtype  # unknown dtypes stay a string
        self.shape = tuple(int(s) for s in shape)
        self.file = file

    def describe(self) -> str:
        d = dtype_name(self.dtype) if isinstance(self.dtype, torch.dtype) else self.dtype
        return f"{d} {list(self.shape)}"


class CheckpointReader:
    """Tensors of a checkpoint directory, read lazily one at a time.

    ``on_read`` (tests use it) is called with each host tensor just read from a file, before it
    is moved to the device.
    """

    def __init__(self, path, *, on_read=None):
        self.root = Path(path)
        self.on_read = on_read
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self.files: list[Path] = []
        self._children: dict[str, list[str]] | None = None
        self._locate()
        self._info: dict[str, TensorInfo] = {}

    # ------------------------------------------------------------------ layout

    def _locate(self) -> None:
        if not self.root.is_dir():
            raise CheckpointError(expect("path", "a checkpoint directory", f"{str(self.root)!r} (not a directory)"))
        index = self.root / INDEX_FILE
        single = self.root / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(
                    expect(str(index), "a safetensors index with a 'weight_map' object", f"unreadable JSON ({e})")
                ) from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(expect(f"{index}: weight_map", "an object", type(weight_map).__name__))
            files = []
            for name, fname in weight_map.items():
                f = self.root / str(fname)
                if f not in files:
                    if not f.is_file():
                        raise CheckpointError(
                            expect(f"{index}: {name}", f"a shard file {fname!r}", "no such file in the checkpoint")
                        )
                    files.append(f)
                self._where[name] = f
            self.files = files
        elif single.is_file():
            self.files = [single]
        else:
            raise CheckpointError(
                expect("path", f"a checkpoint directory holding {SINGLE_FILE} or {INDEX_FILE}",
                       f"{str(self.root)!r} without either")
            )
        # Read every header now: a truncated or corrupt file is refused before any work, and the
        # index is checked against what the shards hold.
        seen: dict[str, Path] = {}
        for f in self.files:
            for name in self._handle(f).keys():
                if name in seen:
                    raise CheckpointError(expect(name, "one stored copy", f"copies in {seen[name].name} and {f.name}"))
                seen[name] = f
                if self._where and self._where.get(name) != f:
                    raise CheckpointError(
                        expect(f"{INDEX_FILE}: {name}", f"the shard that holds it ({f.name})",
                               str(self._where.get(name)))
                    )
        for name, f in self._where.items():
            if name not in seen:
                raise CheckpointError(expect(f"{INDEX_FILE}: {name}", f"a tensor in {f.name}", "no such tensor"))
        self._where = seen

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import SafetensorError, safe_open

            try:
                h = safe_open(str(f), framework="pt", device="cpu")
            except SafetensorError as e:
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            except OSError as e:
                raise CheckpointError(f"{f}: cannot be opened ({e})") from None
            self._handles[f] = h
        return h

    def metadata(self, f: Path | None = None) -> dict:
        return dict(self._handle(f or self.files[0]).metadata() or {})

    # ------------------------------------------------------------------ queries

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def children(self, prefix: str) -> list[str]:
        """The stored names ``prefix.<local>`` (one more dotted component), e.g. a layer's tensors."""
        if self._children is None:
            self._children = {}
            for name in self._where:
                parent = name.rpartition(".")[0]
                self._children.setdefault(parent, []).append(name)
        return list(self._children.get(prefix, ()))

    def info(self, name: str) -> TensorInfo:
        """dtype and shape of ``name`` from the header (no data read)."""
        i = self._info.get(name)
        if i is None:
            if name not in self._where:
                raise KeyError(name)
            f = self._where[name]
            sl = self._handle(f).get_slice(name)
            raw = sl.get_dtype()
            i = self._info[name] = TensorInfo(name, _DTYPES.get(raw), raw, sl.get_shape(), f)
        return i

    def read(self, name: str, device=None) -> torch.Tensor:
        """The tensor ``name`` on ``device`` (default CPU). The host copy is dropped on return."""
        f = self._where[name]
        from safetensors import SafetensorError

        try:
            t = self._handle(f).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f}: {name}: cannot be read ({e})") from None
        if self.on_read is not None:
            self.on_read(name, t)
        return to_device(t, device)

    def read_slices(self, name: str, per_dim) -> torch.Tensor:
        """Part of ``name`` on the CPU, read with safetensors' ``get_slice`` (the rest of the
        tensor is never read): ``per_dim[d]`` is None (all of dim d) or a list of [start, stop)
        ranges, concatenated along d (at most one dim with several ranges). ``on_read`` is not
        called (the caller reports what it keeps)."""
        from safetensors import SafetensorError

        multi = [d for d, rs in enumerate(per_dim) if rs is not None and len(rs) > 1]
        assert len(multi) <= 1, per_dim
        pieces = per_dim[multi[0]] if multi else [None]
        f = self._where[name]
        try:
            sl = self._handle(f).get_slice(name)
            out = []
            for piece in pieces:
                index = tuple(slice(None) if rs is None else slice(*(piece if d in multi else rs[0]))
                              for d, rs in enumerate(per_dim))
                out.append(sl[index])
        except SafetensorError as e:
            raise CheckpointError(f"{f}: {name}: cannot be read ({e})") from None
        return out[0] if len(out) == 1 else torch.cat(out, multi[0])

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Move one tensor read from a file to ``device`` (None: stay on the CPU)."""
    if device is None:
        return t
    return t.to(device)


# ----------------------------------------------------------------------------- writing


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_checkpoint(tensors, path, *, max_shard_size: int | str = "5GB", metadata: dict | None = None) -> list[Path]:
    """Write ``tensors`` (an iterable of (name, tensor)) as safetensors shards under ``path``.

    One file ``model.safetensors`` when everything fits in ``max_shard_size`` bytes, otherwise
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Each tensor is
    copied to the host as its shard is written; at most one shard is held in host memory.
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    items = list(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(expect("tensors", "unique names", f"duplicates {dup}"))
    # Plan shards by size (metadata only), then materialize one shard at a time.
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, t) in enumerate(items):
        nb = _nbytes(t)
        if shards[-1] and size + nb > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nb
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    for stale in list(root.glob("model*.safetensors")) + [root / INDEX_FILE]:
        if stale.exists():
            stale.unlink()
    written = []
    weight_map = {}
    for s, idx in enumerate(shards):
        fname = SINGLE_FILE if len(shards) == 1 else f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {}
        for i in idx:
            name, t = items[i]
            shard[name] = t.detach().to("cpu").contiguous()
            weight_map[name] = fname
        save_file(shard, str(root / fname), metadata=meta)
        del shard
        written.append(root / fname)
    if len(shards) > 1:
        total = sum(_nbytes(t) for _, t in items)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(root / INDEX_FILE)
    return written


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size) -> int:
    """``"5GB"`` -> 5e9 bytes (also KB/MB, KiB/MiB/GiB, or an int)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        s = size.strip().upper()
        for unit in sorted(_UNITS, key=len, reverse=True):
            if s.endswith(unit):
                num = s[: -len(unit)].strip()
                try:
                    v = float(num)
                except ValueError:
                    break
                if v > 0:
                    return int(v * _UNITS[unit])
                break
    raise CheckpointError(expect("max_shard_size", "a positive byte count or a size like '5GB'", repr(size)))


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(expect(what, f"a file {path}", "no such file")) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(expect(what, "valid JSON", f"{path}: {e}")) from None
    if not isinstance(data, dict):
        raise CheckpointError(expect(what, "a JSON object", type(data).__name__))
    return data


def write_json(path: Path, data: dict) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
