"""Two ranks (gloo) save and load ebbtide checkpoints; GPT-2 compression ratio."""
import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ebbtide import checkpoint as ckpt
from ebbtide.checkpoint import native_save


def _rank_state(rank):
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(256, 512, generator=g), "rank": rank, "ids": torch.arange(10) * (rank + 1)}


def _two_ranks(worker, tmp_path, *args):
    """Runs worker(rank, 2, init_file, *args, results) on two processes; returns results (rank -> value)."""
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "init"), *args, results), nprocs=2, join=True)
    return results


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
    results = _two_ranks(_worker, tmp_path, path)
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
    results = _two_ranks(_striped_worker, tmp_path, path, dirs)
    assert results[0] and results[1]
    for d in dirs:  # one stripe directory (the committed one) with both ranks' files
        (sd,) = os.listdir(d)
        assert sorted(os.listdir(os.path.join(d, sd))) == ["owner.json", "rank0.ebt", "rank1.ebt"]
    both = ckpt.load(path, rank="all")
    assert [s["rank"] for s in both] == [10, 11]
    assert all(not s["problems"] for s in ckpt.inspect(path)["shards"])


def _record_object_collectives(monkeypatch_target, calls):
    """Wraps torch.distributed's object collectives to record (thread, group)."""
    for name in ("broadcast_object_list", "all_gather_object"):
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, threading.current_thread().name, kwargs.get("group")))
            return _real(*args, **kwargs)
        setattr(monkeypatch_target, name, wrapped)


def _background_worker(rank, world, init_file, path, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # A default group that moves objects through CUDA tensors, as NCCL's does: the checkpoint's
        # collectives must go over a gloo group of their own (Note [Checkpoint collectives]).
        dist.get_backend = lambda group=None: "nccl"
        calls = []
        _record_object_collectives(dist, calls)
        # The first save makes that group (a rendezvous of all ranks, once, on the caller's thread).
        ckpt.save(_rank_state(rank + 10), path, async_=True, snapshot="background").wait()
        calls.clear()
        if rank == 1:
            time.sleep(2.0)  # rank 0's reservation cannot complete before rank 1 gets here
        t0 = time.perf_counter()
        h = ckpt.save(_rank_state(rank), path, async_=True, snapshot="background")
        returned = time.perf_counter() - t0
        in_save = list(calls)
        h.wait()  # collective
        out = ckpt.load(path)
        exp = _rank_state(rank)
        results[rank] = dict(
            returned=returned, loaded=torch.equal(out["w"], exp["w"]) and out["rank"] == rank,
            caller_in_save=[c[0] for c in in_save if c[1] == threading.current_thread().name],
            threads={c[1] for c in calls if c[1] != threading.current_thread().name},
            groups={"default" if c[2] is None else "own" for c in calls}, collectives=len(calls))
    finally:
        dist.destroy_process_group()


# Note [Checkpoint collectives]: under a process group whose object
# collectives would wait for the GPU (NCCL), a background save (after the
# first, which makes the group) returns at once, before the other rank has
# even called save(): the reservation's broadcast runs on the snapshot
# thread, over a gloo group of the checkpoint's own, and wait()'s agreement
# over the same group.
def test_background_save_does_not_wait_for_the_reservation_collective(tmp_path):
    path = str(tmp_path / "c")
    results = _two_ranks(_background_worker, tmp_path, path)
    for rank in (0, 1):
        r = results[rank]
        assert r["loaded"], rank
        assert r["caller_in_save"] == [], f"rank {rank}: save() ran {r['caller_in_save']} on the caller's thread"
        assert r["threads"] == {"ebbtide-ckpt-snapshot"}, r
        assert r["groups"] == {"own"}, f"rank {rank}: an object collective went over the default group"
        assert r["collectives"] == 3, r  # the reservation's broadcast; wait()'s gather and broadcast
    assert results[0]["returned"] < 1.0, f"rank 0's save() waited {results[0]['returned']:.2f} s for rank 1"


def _two_writers_worker(rank, world, init_file, paths, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        reserve = native_save._Save.reserve_directories

        def late_on_rank1(self):
            if rank == 1 and self.path.endswith("a"):
                time.sleep(1.0)  # rank 1's first save reaches its reservation after its second
            return reserve(self)
        native_save._Save.reserve_directories = late_on_rank1
        wa, wb = ckpt.Writer(), ckpt.Writer()
        ha = wa.save(_rank_state(rank), paths[0], async_=True, snapshot="background")
        hb = wb.save(_rank_state(rank + 10), paths[1], async_=True, snapshot="background")
        hb.wait()
        ha.wait()
        a, b = ckpt.load(paths[0]), ckpt.load(paths[1])
        results[rank] = (a["rank"] == rank and b["rank"] == rank + 10
                         and torch.equal(b["w"], _rank_state(rank + 10)["w"]))
    finally:
        dist.destroy_process_group()


# Reservations on snapshot threads and waits on the caller's thread keep one
# order on every rank (tickets taken in program order), also when a rank's
# snapshot threads run out of order: two writers' background saves, the
# first one's reservation late on rank 1, waited for in the other order.
def test_background_saves_of_two_writers_agree_in_program_order(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    results = _two_ranks(_two_writers_worker, tmp_path, paths)
    assert results[0] and results[1]


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
