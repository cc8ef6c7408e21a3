"""`ebbtide demo` end to end on a tiny configuration."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


@pytest.mark.parametrize("model", ["llama", "mixtral", "gpt2", "bert", "t5"])
def test_demo_json_all_methods(cli, tmp_path, model):
    png = tmp_path / "demo.png"
    proc = cli("demo", "--model", model, "--layers", "2", "--hidden", "64", "--heads", "4",
               "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0", "--device", "cpu",
               "--png", str(png), "--path", str(tmp_path), "--json")
    r = json.loads(proc.stdout)
    assert r["model"] == model
    methods = [row["method"] for row in r["rows"]]
    assert methods == ["none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu"]
    for row in r["rows"]:
        assert row["step_seconds"] > 0
        # every method computes the same gradients as no offload, bitwise
        assert row["max_grad_diff"] == 0.0, row
    ssd = r["rows"][1]
    assert ssd["bytes_written"] > 0
    # every byte written is a completed store or one whose tensor was forwarded while it ran
    assert ssd["stats"]["bytes_offloaded"] + ssd["stats"]["bytes_discarded"] == ssd["bytes_written"]
    assert png.stat().st_size > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["demo.png"]  # no files left behind


def test_demo_auto_method(cli, tmp_path):
    """ebbtide-auto (the default target, adaptive) is accepted; its first step profiles."""
    proc = cli("demo", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2",
               "--steps", "1", "--warmup", "1", "--device", "cpu", "--methods", "none,ebbtide-auto,ebbtide-cpu",
               "--png", "", "--path", str(tmp_path), "--json")
    r = json.loads(proc.stdout)
    assert r["model"] == "llama"  # the default
    rows = {row["method"]: row for row in r["rows"]}
    auto = rows["ebbtide-auto"]
    assert auto["max_grad_diff"] == 0.0
    assert auto["stats"]["adaptive"] and auto["stats"]["planner"] is not None
    # On CPU auto has no host tier: what it offloads goes to SSD files.
    assert auto["bytes_written"] == auto["stats"]["bytes_offloaded"] + auto["stats"]["bytes_discarded"]
    assert rows["ebbtide-cpu"]["bytes_written"] == 0 and rows["ebbtide-cpu"]["stats"]["bytes_offloaded"] > 0


# The architecture each choice builds and what sets it apart.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
                 "t5": "T5ForConditionalGeneration"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_demo_models_build_and_train(name):
    """Every --model choice builds the architecture it names at the asked shape
    and takes a training step (every Llama-family parameter gets a gradient)."""
    import torch

    from ebbtide.harness.models import DEFAULT_MODEL, MODELS, build_model

    assert set(MODELS) == set(ARCHITECTURES) and DEFAULT_MODEL == "llama"
    torch.manual_seed(0)
    model, make_batch = build_model(name, 2, 64, 8, 32, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == ARCHITECTURES[name]
    cfg = model.config
    if name in ("llama", "qwen2", "mistral", "mixtral"):
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 8)
        assert cfg.num_key_value_heads == 2  # grouped-query attention
        assert cfg.intermediate_size == 192  # 8/3 * 64 rounded up to 64
    if name == "mistral":
        assert cfg.sliding_window == 16  # shorter than the sequence: the window masks
    if name == "mixtral":
        assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (4, 2) and cfg.output_router_logits
    out = model(**make_batch(2, torch.Generator().manual_seed(0)))
    if name == "mixtral":
        assert out.aux_loss is not None and out.aux_loss.item() > 0  # the router's loss is in the loss
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    if name in ("llama", "qwen2", "mistral", "mixtral"):
        assert not no_grad, f"{name}: parameters without a gradient: {no_grad[:5]}"


def test_demo_table(cli, tmp_path):
    proc = cli("demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32",
               "--batch", "1", "--steps", "1", "--warmup", "0", "--methods", "none,recompute",
               "--png", "")
    assert "max|dgrad|" in proc.stdout and "recompute" in proc.stdout


def test_demo_bad_input(cli):
    proc = cli("demo", "--methods", "none,teleport", check=False)
    assert proc.returncode != 0 and "teleport" in proc.stderr
    proc = cli("demo", "--hidden", "30", "--heads", "4", "--png", "", check=False)
    assert proc.returncode != 0 and "divisible" in proc.stderr
