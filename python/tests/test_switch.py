"""The switch (issue 41, part 5): `ebbtide run --target cpu -- COMMAND` and
EBBTIDE_OFFLOAD run an unchanged HF Trainer script, Lightning script and
torchtune recipe with offloading, bitwise equal to the integration added by
hand (or, for torchtune's recipe, to the recipe without offloading, which
the integration equals bitwise), with the ebbtide/* metrics in their logs;
it reaches torchrun's and accelerate's worker processes too."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "switch_scripts"
# Every tensor may be offloaded, and stores finish before backward (conftest's stores_before_backward).
ENV = dict(EBBTIDE_MIN_BYTES="0", EBBTIDE_MAX_INFLIGHT="1")


def run(args, switch=None, timeout=300, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EBBTIDE_OFFLOAD")}
    env.update(ENV)
    if switch == "env":
        env["EBBTIDE_OFFLOAD"] = "cpu"
    elif switch == "run":
        args = [sys.executable, "-m", "ebbtide", "run", "--target", "cpu", "--", *args]
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert p.returncode == 0, f"{args} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def test_hf_trainer_script_under_ebbtide_run_equals_the_callback_by_hand(tmp_path):
    run([sys.executable, SCRIPTS / "hf_train.py", tmp_path / "switch.json"], switch="run")
    run([sys.executable, SCRIPTS / "hf_train.py", tmp_path / "hand.json", "--by-hand"])
    switch, hand = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("switch", "hand"))
    assert switch["params"] == hand["params"]
    for r in (switch, hand):
        assert r["callbacks"].count("ebbtide.integrations.hf.OffloadCallback") == 1, r["callbacks"]
        offloaded = [e["ebbtide/bytes_offloaded"] for e in r["log_history"] if "ebbtide/bytes_offloaded" in e]
        assert len(offloaded) == 3 and all(b > 0 for b in offloaded), r["log_history"]


def test_lightning_script_under_the_variable_equals_the_callback_by_hand(tmp_path):
    pytest.importorskip("pytorch_lightning")
    run([sys.executable, SCRIPTS / "lightning_train.py", tmp_path / "switch.json"], switch="env")
    # By hand, with the switch on as well: a trainer given the callback gets no second one.
    run([sys.executable, SCRIPTS / "lightning_train.py", tmp_path / "hand.json", "--by-hand"], switch="env")
    switch, hand = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("switch", "hand"))
    assert switch["params"] == hand["params"]
    for r in (switch, hand):
        assert r["callbacks"].count("ebbtide.integrations.lightning.OffloadCallback") == 1, r["callbacks"]
        offloaded = [float(m["ebbtide/bytes_offloaded"]) for m in r["metrics"] if m.get("ebbtide/bytes_offloaded")]
        assert len(offloaded) == 3 and all(b > 0 for b in offloaded), r["metrics"]


TORCHTUNE_CONFIG = """\
output_dir: {out}
tokenizer: {{_component_: torchtune.models.llama2.llama2_tokenizer, path: {d}/tok.model, max_seq_len: 32}}
dataset:
  _component_: torchtune.datasets.text_completion_dataset
  source: json
  data_files: {d}/data.json
  column: text
  split: train
seed: 0
shuffle: False
batch_size: 2
model: {{_component_: torchtune.models.llama2.llama2, vocab_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2,
         embed_dim: 32, max_seq_len: 32, intermediate_dim: 64}}
checkpointer:
  _component_: torchtune.training.FullModelTorchTuneCheckpointer
  checkpoint_dir: {d}
  checkpoint_files: [model.pt]
  output_dir: {out}
  model_type: LLAMA2
resume_from_checkpoint: False
optimizer: {{_component_: torch.optim.AdamW, lr: 0.01}}
loss: {{_component_: torchtune.modules.loss.CEWithChunkedOutputLoss}}
epochs: 1
max_steps_per_epoch: 3
gradient_accumulation_steps: 2
optimizer_in_bwd: False
compile: False
device: cpu
dtype: fp32
enable_activation_checkpointing: False
enable_activation_offloading: False
metric_logger: {{_component_: torchtune.training.metric_logging.DiskLogger, log_dir: {out}/logs}}
log_every_n_steps: 1
log_peak_memory_stats: False
clip_grad_norm: null
"""


def torchtune_inputs(d):
    """A tokenizer, a data file and a random-init checkpoint of a tiny Llama 2, made here (nothing downloaded)."""
    import random

    import sentencepiece as spm
    from torchtune.models.llama2 import llama2

    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in green trees".split()
    rnd = random.Random(0)
    lines = [" ".join(rnd.choice(words) for _ in range(24)) for _ in range(40)]
    (d / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "tok"), vocab_size=60,
                                   model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2)
    (d / "data.json").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:24]))
    torch.manual_seed(0)
    model = llama2(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
                   intermediate_dim=64)
    torch.save(model.state_dict(), d / "model.pt")


def test_torchtune_recipe_under_the_switch_equals_the_recipe_without_offloading(tmp_path):
    pytest.importorskip("torchtune.training")
    pytest.importorskip("torchdata")
    import importlib.util

    # What `tune run full_finetune_single_device` runs (torchtune's recipes folder is not importable).
    recipe = Path(importlib.util.find_spec("recipes").origin).parent / "full_finetune_single_device.py"
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    torchtune_inputs(inputs)
    results = {}
    for name, switch in (("switch", "run"), ("plain", None)):
        out = tmp_path / name
        (tmp_path / f"{name}.yaml").write_text(TORCHTUNE_CONFIG.format(out=out, d=inputs))
        run([sys.executable, recipe, "--config", tmp_path / f"{name}.yaml"], switch=switch, cwd=tmp_path)
        (log,) = (out / "logs").glob("*.txt")
        (weights,) = out.glob("epoch_0/*.bin")
        results[name] = (log.read_text(), torch.load(weights, weights_only=True))
    (log, got), (plain_log, ref) = results["switch"], results["plain"]
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    steps = [line for line in log.splitlines() if line.startswith("Step ")]
    offloaded = [int(part.split(":")[1]) for s in steps for part in s.split() if part.startswith("ebbtide/bytes_off")]
    assert len(steps) == 3 and len(offloaded) == 3 and all(b > 0 for b in offloaded), log
    assert "ebbtide/" not in plain_log


PROBE = textwrap.dedent("""
    import os, sys
    print("SWITCH", os.environ.get("RANK", "-"), "ebbtide.integrations.switch" in sys.modules,
          any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path))
""")


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_the_switch_reaches_the_launchers_workers(tmp_path, launcher):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0", script]
    else:
        pytest.importorskip("accelerate")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", script]
    out = run(cmd, switch="run", cwd=tmp_path).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("SWITCH"))
    assert lines and all(line.endswith("True True") for line in lines), out
    if launcher == "torchrun":
        assert [line.split()[1] for line in lines] == ["0", "1"], out


def test_a_bad_value_ends_the_process_in_one_line():
    env = dict(os.environ, EBBTIDE_OFFLOAD="gpu")
    p = subprocess.run([sys.executable, "-c", "print('trained')"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "trained" not in p.stdout, p
    assert p.stderr.startswith("ebbtide: ") and "EBBTIDE_OFFLOAD" in p.stderr and "gpu" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_ebbtide_run_runs_the_python_beside_it(tmp_path):
    # As from a shell that has not activated the environment: `python` is
    # this environment's, with the switch, not the first one on PATH.
    env = dict(os.environ, PATH=os.pathsep.join(["/usr/bin", "/bin"]))
    code = "import sys; print(sys.prefix, 'ebbtide.integrations.switch' in sys.modules)"
    p = subprocess.run([sys.executable, "-m", "ebbtide", "run", "python", "-c", code], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.split() == [sys.prefix, "True"], (p.stdout, p.stderr)


def test_ebbtide_run_checks_its_settings():
    for args, text in ((["--target", "cpu", "--path", "/tmp", "--", "true"], "--target cpu offloads to host memory"),
                       (["--budget", "-5GiB", "--", "true"], "--budget"),
                       (["--", "no-such-command-ebbtide"], "no-such-command-ebbtide: command not found")):
        p = subprocess.run([sys.executable, "-m", "ebbtide", "run", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and p.stderr.startswith("ebbtide run: error: ") and text in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
