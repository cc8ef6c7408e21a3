"""The README's `ebbtide plan` example fits and its sections agree (issue 41,
part 4); a model state that does not fit is said first, with the fix."""
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def plan(*args):
    p = subprocess.run([sys.executable, "-m", "ebbtide", "plan", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def rows(text):
    return {line[:20].strip(): line[20:].strip() for line in text.splitlines() if line.strip()}


def test_the_readme_example_fits_and_its_sections_agree():
    (command,) = re.findall(r"`(ebbtide plan --model [^`]*--activation-budget[^`]*)`", README.read_text())
    out = plan(*command.split()[2:])
    assert "DOES NOT FIT" not in out and "exceeds GPU memory" not in out, out
    r = rows(out)
    assert not r["max micro-batch"].startswith("0 "), out
    layers = int(re.search(r"(\d+) layers", r["model"]).group(1))
    budget = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.split("\n\n")[1].splitlines()
              if "  " in line}
    mix = re.match(r"(\d+) layers: (.*); head (\w+)$", budget["mix"])
    assert mix and int(mix.group(1)) == layers, budget["mix"]
    in_mix = sum(int(n) for n in re.findall(r" (\d+)(?:,|$)", mix.group(2)))
    by_layer = sum(int(k or 1) for k in re.findall(r"\w+(?: x(\d+))?(?:,|$)", budget["by layer"]))
    assert in_mix == by_layer == layers, (budget["mix"], budget["by layer"])
    assert "NOT MET" not in budget["activation budget"], out


def test_a_model_state_that_does_not_fit_is_said_first_with_the_fix():
    out = plan("--model", "llama3-8b", "--seq", "8192", "--activation-budget", "20GiB")
    first = out.splitlines()[0]
    assert first.startswith("DOES NOT FIT") and "--fsdp or --zero 1|2|3 with --dp" in first, out
