"""The package's layout (issue 32): the public imports the docs name, the
layers python/ebbtide/ is arranged in (as cpp/src is), and no source file over
800 lines. Each layer's allowed imports are stated in its __init__.py."""
import ast
import importlib
import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
PKG = REPO / "python" / "ebbtide"
MAX_LINES = 800


def test_public_imports_stay_as_documented():
    import ebbtide
    from ebbtide import checkpoint, dcp
    from ebbtide.cache import TensorCache, offload
    assert ebbtide.offload is offload and ebbtide.TensorCache is TensorCache
    assert callable(checkpoint.save) and callable(checkpoint.load) and callable(checkpoint.inspect)
    assert callable(checkpoint.save_safetensors) and callable(checkpoint.load_safetensors)
    assert ebbtide.checkpoint is checkpoint
    assert dcp.EbbtideWriter.__module__ == "ebbtide.checkpoint.dcp_writer"
    assert dcp.EbbtideReader.__module__ == "ebbtide.checkpoint.dcp_reader"
    assert callable(dcp.load_metadata) and callable(dcp.inspect)
    assert ebbtide.model.__name__ == "ebbtide.plan.model"
    # The integrations import their framework only when used: each module is
    # there, and `require` names what to install.
    for name in ("hf", "lightning", "torchtune", "pipeline", "ray", "megatron"):
        assert importlib.util.find_spec(f"ebbtide.integrations.{name}") is not None, name


def _imports_of(path):
    """The ebbtide modules `path` imports, anywhere in it (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ebbtide"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ebbtide"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# layer -> layers it must not import (Note: the harness is apart from the library;
# checkpoints and the activation cache do not know each other; the planner and
# model work without torch, so they import neither).
FORBIDDEN = {
    "cache": {"checkpoint", "dcp", "harness", "commands", "integrations"},
    "checkpoint": {"cache", "plan", "harness", "commands", "integrations"},
    "plan": {"cache", "checkpoint", "dcp", "harness", "commands", "integrations"},
    "integrations": {"harness", "commands", "checkpoint", "dcp"},
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_what_their_folder_allows(layer):
    bad = []
    for path in sorted((PKG / layer).glob("*.py")):
        for mod in _imports_of(path):
            if _layer(mod) in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_library_never_imports_the_harness():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ("harness", "commands"):
            continue  # the commands run the harness (ebbtide demo, ebbtide rok)
        bad += [f"{rel} imports {m}" for m in _imports_of(path) if _layer(m) == "harness"]
    assert not bad, "\n".join(bad)


def test_no_source_file_over_800_lines():
    roots = [PKG, REPO / "python" / "src", REPO / "python" / "tests", REPO / "cpp", REPO / "bench"]
    long = []
    for root in roots:
        for path in root.rglob("*"):
            if path.suffix in (".py", ".cpp", ".hpp", ".h") and path.is_file():
                n = sum(1 for _ in path.open(errors="replace"))
                if n > MAX_LINES:
                    long.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not long, "split these by job (issue 32):\n" + "\n".join(long)


def test_each_folder_says_what_lives_there():
    for layer in ("cache", "checkpoint", "plan", "harness"):
        doc = importlib.import_module(f"ebbtide.{layer}").__doc__ or ""
        assert "import" in doc or layer == "harness", f"ebbtide/{layer}/__init__.py names no import rule"
        for path in (PKG / layer).glob("*.py"):
            if path.name != "__init__.py":
                assert path.name in doc, f"ebbtide/{layer}/__init__.py does not describe {path.name}"
