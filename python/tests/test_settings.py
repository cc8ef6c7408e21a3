"""The one settings table (cpp/src/util/settings.cpp): every EBBTIDE_*
variable is read through it, docs/configuration.md lists exactly its rows,
and arguments and variables are checked against the same row."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ebbtide
from ebbtide import _core, _settings
from ebbtide.commands.config import markdown_tables

ROOT = Path(__file__).resolve().parents[2]


def test_docs_list_exactly_the_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = _settings.table()
    for section, table in markdown_tables(rows).items():
        assert f"## {section}\n" in doc, section
        assert table in doc, f"docs/configuration.md, section {section!r}: run `ebbtide config --markdown`"
    documented = set(re.findall(r"^\| `(EBBTIDE_[A-Z0-9_]+)` \|", doc, flags=re.M))
    assert documented == {s.name for s in rows}


def test_only_the_core_reads_ebbtide_variables():
    offenders = []
    python_read = re.compile(r"(environ|getenv)[^\n]*EBBTIDE_")
    for path in list((ROOT / "python" / "ebbtide").rglob("*.py")) + list((ROOT / "bench").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if python_read.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    for folder in ("cpp/src", "cpp/include", "python/src"):
        for path in (ROOT / folder).rglob("*.[ch]pp"):
            if path.name == "config.cpp":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bgetenv\s*\(", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "read EBBTIDE_* settings through ebbtide::config / ebbtide._settings:\n" + \
        "\n".join(offenders)


def test_names_outside_the_table_are_refused():
    with pytest.raises(RuntimeError, match="EBBTIDE_NOT_A_SETTING"):
        _core.env_setting("EBBTIDE_NOT_A_SETTING")


@pytest.mark.parametrize("name, text, value", [
    ("EBBTIDE_MIN_BYTES", "1MiB", 1 << 20),
    ("EBBTIDE_CACHE_WORKERS", " 3 ", 3),
    ("EBBTIDE_MAX_WRITE_MBPS", "2.5", 2.5),
    ("EBBTIDE_ADAPTIVE", "Off", False),
    ("EBBTIDE_IO_BACKEND", "IO_URING", "io_uring"),
])
def test_variables_are_parsed_as_their_kind(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert _core.env_setting(name) == value
    monkeypatch.setenv(name, "")
    assert _core.env_setting(name) is None


def test_argument_and_variable_share_the_row(monkeypatch):
    with pytest.raises(ValueError, match=r"ebbtide.TensorCache: workers=65 is out of range \[1, 64\]"):
        ebbtide.TensorCache(target="cpu", workers=65)
    with pytest.raises(ValueError, match=r"ebbtide.TensorCache: workers=True must be an integer"):
        ebbtide.TensorCache(target="cpu", workers=True)
    monkeypatch.setenv("EBBTIDE_CACHE_WORKERS", "65")
    with pytest.raises(ValueError, match=r"environment variable EBBTIDE_CACHE_WORKERS=65 is out of range \[1, 64\]"):
        ebbtide.TensorCache(target="cpu")
    with ebbtide.TensorCache(target="cpu", workers=3) as c:  # the argument wins over the variable
        assert "3 workers" in c.describe()
    monkeypatch.setenv("EBBTIDE_CACHE_WORKERS", "5")
    with ebbtide.TensorCache(target="cpu") as c:
        assert "5 workers" in c.describe()


def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ebbtide", "config", *args], capture_output=True, text=True,
                          env=e, timeout=120)


def test_config_command_shows_values_and_names_bad_ones():
    ok = _cli("--json", env={"EBBTIDE_MIN_BYTES": "2KiB"})
    assert ok.returncode == 0, ok.stderr
    rows = {r["name"]: r for r in json.loads(ok.stdout)}
    assert rows["EBBTIDE_MIN_BYTES"]["value"] == 2048
    assert rows.keys() == {s.name for s in _settings.table()}
    bad = _cli(env={"EBBTIDE_IO_QUEUE_DEPTH": "0"})
    assert bad.returncode == 2
    assert "EBBTIDE_IO_QUEUE_DEPTH=0 is out of range [1, 4096]" in bad.stdout
