"""Each integration imports its framework only when imported itself, and a
missing framework raises ImportError naming the pip package and the extra."""
import importlib
import re
import sys

import pytest

import ebbtide.integrations

CASES = [("ebbtide.integrations.hf", "transformers", "transformers", "hf"),
         ("ebbtide.integrations.lightning", "pytorch_lightning", "pytorch-lightning", "lightning"),
         ("ebbtide.integrations.ray", "ray.train", "ray[train]", "ray")]


@pytest.mark.parametrize("module,framework,package,extra", CASES, ids=[c[3] for c in CASES])
def test_missing_framework_names_package_and_extra(monkeypatch, module, framework, package, extra):
    monkeypatch.setitem(sys.modules, framework, None)  # `import framework` raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    message = rf"needs the package '{re.escape(package)}'.*pip install 'ebbtide\[{extra}\]'"
    with pytest.raises(ImportError, match=message):
        importlib.import_module(module)
    monkeypatch.delitem(sys.modules, module, raising=False)


def test_torchtune_and_pipeline_import_without_their_frameworks(monkeypatch):
    # Their frameworks are needed only by the calls that use them.
    monkeypatch.setitem(sys.modules, "torchtune", None)
    monkeypatch.setitem(sys.modules, "torchtune.training", None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.pipe.schedule", None)  # may be imported already
    for name in ("ebbtide.integrations.torchtune", "ebbtide.integrations.pipeline"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    tt = sys.modules["ebbtide.integrations.torchtune"]
    with pytest.raises(ImportError, match=r"needs the package 'torchtune'.*ebbtide\[torchtune\]"):
        tt.install()
    pipe = sys.modules["ebbtide.integrations.pipeline"]
    with pytest.raises(ImportError, match=r"needs the package 'deepspeed'.*ebbtide\[deepspeed\]"):
        pipe.hinted_instruction_map({}, None)
    for name in ("ebbtide.integrations.torchtune", "ebbtide.integrations.pipeline"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_require_returns_the_module():
    assert ebbtide.integrations.require("json", "json", "hf", "test") is sys.modules["json"]
