"""Two ranks (gloo) save and load ebbtide checkpoints; GPT-2 compression ratio."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ebbtide import checkpoint as ckpt


def _rank_state(rank):
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(256, 512, generator=g), "rank": rank, "ids": torch.arange(10) * (rank + 1)}


def _worker(rank, world, init_file, path, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        info = ckpt.save(_rank_state(rank), path)
        assert os.path.exists(os.path.join(path, "index.json"))
        h = ckpt.save(_rank_state(rank + 10), path, async_=True, compress="lossless")
        h.wait()  # collective
        out = ckpt.load(path)
        exp = _rank_state(rank + 10)
        ok = out["rank"] == rank + 10 and torch.equal(out["w"], exp["w"]) and torch.equal(out["ids"], exp["ids"])
        results[rank] = (ok, info["file"])
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_and_load(tmp_path):
    path = str(tmp_path / "c")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), path, results), nprocs=2, join=True)
    assert results[0][0] and results[1][0]
    assert sorted(os.listdir(path)) == ["index.json", "rank0.ebt", "rank1.ebt"]
    # One process: a chosen rank, or all of them.
    assert ckpt.load(path, rank=1)["rank"] == 11
    both = ckpt.load(path, rank="all")
    assert [s["rank"] for s in both] == [10, 11]
    with pytest.raises(ValueError, match="2 shards"):
        ckpt.load(path)


def _striped_worker(rank, world, init_file, path, dirs, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        w = ckpt.Writer(chunk_bytes=64 << 10)
        w.save(_rank_state(rank), path, stripe_dirs=dirs)
        w.save(_rank_state(rank + 10), path, stripe_dirs=dirs, async_=True).wait()  # collective
        out = ckpt.load(path)
        exp = _rank_state(rank + 10)
        results[rank] = out["rank"] == rank + 10 and torch.equal(out["w"], exp["w"])
    finally:
        dist.destroy_process_group()


def test_two_ranks_striped(tmp_path):
    path = str(tmp_path / "c")
    dirs = [str(tmp_path / "s1"), str(tmp_path / "s2")]
    for d in dirs:
        os.mkdir(d)
    results = mp.Manager().dict()
    mp.spawn(_striped_worker, args=(2, str(tmp_path / "init"), path, dirs, results), nprocs=2, join=True)
    assert results[0] and results[1]
    for d in dirs:  # one stripe directory (the committed one) with both ranks' files
        (sd,) = os.listdir(d)
        assert sorted(os.listdir(os.path.join(d, sd))) == ["owner.json", "rank0.ebt", "rank1.ebt"]
    both = ckpt.load(path, rank="all")
    assert [s["rank"] for s in both] == [10, 11]
    assert all(not s["problems"] for s in ckpt.inspect(path)["shards"])


def _gpt2_bf16_ratio(tmp_path, trained):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    if trained:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(5):
            ids = torch.randint(0, cfg.vocab_size, (4, 64))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    sd = {k: v.detach().bfloat16() for k, v in model.state_dict().items()}
    info = ckpt.save(sd, tmp_path / ("t" if trained else "r"), compress="lossless")
    out = ckpt.load(tmp_path / ("t" if trained else "r"))
    for k, v in sd.items():
        assert torch.equal(out[k].view(torch.int16), v.view(torch.int16)), k
    return info["ratio"]


@pytest.mark.parametrize("trained", [False, True], ids=["random-init", "adamw-5-steps"])
def test_gpt2_bf16_lossless_ratio(tmp_path, trained):
    ratio = _gpt2_bf16_ratio(tmp_path, trained)
    print(f"gpt2 bf16 lossless ratio ({'trained' if trained else 'random init'}): {ratio:.3f}")
    assert ratio >= 1.4
