"""The transformers releases tileq supports (integrations/compat.py), checked against the release
installed: dev/test runs this file in both environments (transformers 5.17 and the newest), so each
supported end has its own run of every check here."""

import inspect
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tileq.integrations import compat  # noqa: E402
from tileq.errors import UnsupportedError  # noqa: E402
from tileq.version import TESTED, in_tested_range  # noqa: E402

pytestmark = pytest.mark.transformers

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_release_is_in_the_tested_range():
    assert in_tested_range("transformers", transformers.__version__)
    compat.require_supported("a test")  # neither raises nor warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.require_supported("a test", transformers.__version__)


def test_an_older_release_is_refused_and_a_newer_one_warns_once():
    with pytest.raises(UnsupportedError, match=r"transformers: expected a release from 5\.17 through 5\.25 for "
                                               r"fuse_decoder_.*got 4\.57\.1"):
        compat.require_supported("fuse_decoder_", "4.57.1")
    with pytest.warns(UserWarning, match=r"transformers 9\.1\.0 is newer than the releases tileq is tested with "
                                         r"\(5\.17 through 5\.25\)"):
        compat.require_supported("a test", "9.1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.require_supported("a test", "9.1.0")  # once per version
    assert compat.version_tuple("5.26.0.dev0") == (5, 26)


def test_cache_argument_is_the_models_own():
    from transformers.models.qwen3 import modeling_qwen3 as mq

    name = compat.cache_argument()
    for cls in (mq.Qwen3ForCausalLM, mq.Qwen3Model, mq.Qwen3DecoderLayer, mq.Qwen3Attention):
        params = inspect.signature(inspect.unwrap(cls.forward)).parameters
        assert name in params, (cls.__name__, list(params))
    assert compat.cache_kwargs("c") == {name: "c"}


def test_update_takes_kwargs_as_the_release_calls_it():
    from transformers.models.qwen3 import modeling_qwen3 as mq

    source = inspect.getsource(inspect.unwrap(mq.Qwen3Attention.forward))
    calls = re.findall(r"\.update\(key_states, value_states, self\.layer_idx(.*?)\)", source)
    assert len(calls) == 1
    assert compat.update_takes_kwargs() == ("kwargs=kwargs" in calls[0])


def test_rowwise_hook_takes_what_the_release_passes():
    pytest.importorskip("torch.distributed.tensor")
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    from tileq.distributed.tp import QuantRowwiseParallel

    base = inspect.signature(TensorParallelLayer.transform_output_post_forward).parameters
    ours = inspect.signature(QuantRowwiseParallel.transform_output_post_forward)
    extra = {name: None for name in base if name not in ("self", "module", "output", "mesh")}
    ours.bind(None, None, None, None, **extra)  # the keywords transformers' install_forward passes


def test_pyproject_states_the_tested_ranges():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["hf"]
    for package, (oldest, newest) in TESTED.items():
        spec = next(r for r in reqs if re.match(rf"{package}\b", r))
        major, minor = (int(p) for p in newest.split("."))
        assert spec == f"{package}>={oldest},<{major}.{minor + 1}", spec


def test_version_command_names_the_tested_ranges():
    out = subprocess.run([sys.executable, "-m", "tileq", "--version"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert out.startswith("tileq ")
    assert re.search(rf"transformers {re.escape(transformers.__version__)}: tested \(5\.17 - 5\.25\)", out)
    assert re.search(r"torch \S+: (tested|NOT in the tested range) \(2\.11 - 2\.14\)", out)
