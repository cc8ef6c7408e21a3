"""The performance model's predicted saved bytes per step against what the
tensor cache measures (saved_bytes_total) on the demo models: within 10%."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ebbtide  # noqa: E402
from ebbtide.harness.models import build_model  # noqa: E402
from ebbtide.plan.model import predicted_saved_bytes  # noqa: E402

SEQ, BATCH = 128, 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_predicted_bytes_match_cache(name, dtype, tmp_path):
    torch.manual_seed(0)
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model, make_batch = build_model(name, 2, 64, 4, SEQ, tdt, torch.device("cpu"))
    batch = make_batch(BATCH, torch.Generator().manual_seed(0))
    if name == "t5":  # the model predicts equal encoder and decoder lengths
        batch["labels"] = torch.randint(1, 100, (BATCH, SEQ))
    with ebbtide.offload(model, target="ssd", path=str(tmp_path)) as cache:
        model(**batch).loss.backward()
    measured = cache.stats()["saved_bytes_total"]
    predicted = predicted_saved_bytes(model.config, SEQ, BATCH, dtype)
    assert measured > 0
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
