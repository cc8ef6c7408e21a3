"""Progress bars of the long CLI commands (issue 30, part 3): drawn on stderr
when it is a terminal, never with --json or when stderr is not a terminal."""
import sys

import pytest

from ebbtide import _progress, cli

BAR_MARKS = ("\r", "%|")  # tqdm redraws in place and draws "NN%|"


def has_bar(err):
    return any(m in err for m in BAR_MARKS)


def force_tty(monkeypatch):
    """Makes stderr claim to be a terminal. Called in the test itself: capsys
    puts its stream in place only once the test runs, after the fixtures."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_wanted():
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    assert _progress.wanted(False, Stream(True))
    assert not _progress.wanted(True, Stream(True))  # --json
    assert not _progress.wanted(False, Stream(False))
    assert not _progress.wanted(False, object())  # no isatty at all


def test_hidden_bar_is_silent_and_logs_plainly(capsys):
    with _progress.progress(total=3, desc="work", shown=False, tick_s=0.01) as bar:
        bar.describe("step 1")
        bar.update()
        bar.set(3, 3)
        bar.log()("a line")
    out, err = capsys.readouterr()
    assert out == "a line\n" and err == ""


@pytest.mark.parametrize("tqdm_installed", [True, False])
def test_shown_bar_draws_on_stderr(capsys, monkeypatch, tqdm_installed):
    if not tqdm_installed:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: the plain bar
    with _progress.progress(total=2, desc="work", shown=True) as bar:
        bar.describe("step 1/2")
        bar.update()
        bar.write("a line")
        bar.update()
    out, err = capsys.readouterr()
    assert "step 1/2" in err and has_bar(err)
    assert "a line" in out and "step 1/2" not in out


def test_delay_hides_short_work(capsys):
    with _progress.progress(total=1, desc="work", shown=True, delay=60, tick_s=0.01) as bar:
        bar.update()
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ commands
def _bench(tmp_path, *extra):
    return cli.main(["bench", "io", "--dir", str(tmp_path), "--size", "8MiB", "--no-device", *extra])


def test_bench_io_progress(capsys, monkeypatch, tmp_path):
    force_tty(monkeypatch)
    assert _bench(tmp_path) == 0
    out, err = capsys.readouterr()
    assert "write + read 8.0 MiB" in err and has_bar(err)
    assert "host write" in out


def test_bench_io_quiet_without_terminal_or_with_json(capsys, monkeypatch, tmp_path):
    assert _bench(tmp_path) == 0
    assert not has_bar(capsys.readouterr().err)  # pytest's stderr is no terminal
    force_tty(monkeypatch)
    assert _bench(tmp_path, "--json") == 0
    out, err = capsys.readouterr()
    assert not has_bar(err) and out.lstrip().startswith("{")


@pytest.fixture
def checkpoint_dir(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from ebbtide import checkpoint
    from ebbtide.commands import ckpt

    monkeypatch.setattr(ckpt, "_PROGRESS_DELAY_S", 0.0)  # a small checkpoint verifies at once
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(path))
    return str(path)


def test_ckpt_inspect_progress(capsys, monkeypatch, checkpoint_dir):
    force_tty(monkeypatch)
    assert cli.main(["ckpt", "inspect", checkpoint_dir]) == 0
    out, err = capsys.readouterr()
    assert "verifying" in err and has_bar(err)
    assert "all chunk checksums OK" in out


def test_ckpt_inspect_quiet(capsys, monkeypatch, checkpoint_dir):
    assert cli.main(["ckpt", "inspect", checkpoint_dir]) == 0
    assert "verifying" not in capsys.readouterr().err
    force_tty(monkeypatch)
    for extra in (["--json"], ["--no-verify"]):  # JSON, or nothing long to show
        assert cli.main(["ckpt", "inspect", checkpoint_dir, *extra]) == 0
        assert "verifying" not in capsys.readouterr().err


TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--steps", "1", "--warmup", "1",
        "--device", "cpu"]


def test_demo_progress(capsys, monkeypatch, tmp_path):
    force_tty(monkeypatch)
    pytest.importorskip("transformers")
    assert cli.main(["demo", *TINY, "--batch", "1", "--methods", "none,ebbtide-cpu", "--png", "",
                     "--path", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "step 2/2: " in err and has_bar(err)
    assert "[demo] step" not in out  # the bar stands for the per-round lines
    assert "ebbtide-cpu" in out


def test_demo_quiet_without_terminal_or_with_json(capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    args = ["demo", *TINY, "--batch", "1", "--methods", "none", "--png", "", "--path", str(tmp_path)]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert "[demo] step 2/2" in out and not has_bar(err)
    force_tty(monkeypatch)
    assert cli.main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    assert "[demo] step 2/2" in err and not has_bar(err)  # the log lines, no bar


def test_rok_progress(capsys, monkeypatch, tmp_path):
    force_tty(monkeypatch)
    pytest.importorskip("transformers")
    assert cli.main(["rok", *TINY, "--batch", "1,2", "--path", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "micro-batch 2: step 2/2" in err and has_bar(err)
    assert "recompute" in out
