"""ExCP-style delta chains (docs/checkpoints.md, "Lossy delta checkpoints"):
what a chain keeps of the weights and Adam moments, and how loading one
refuses a broken link, a missing base and a base from another run, naming
the file."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ebbtide import checkpoint as ckpt
from ebbtide.checkpoint import lossy as _lossy


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        loss = (model(x) - x.roll(1, 1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _state(model, opt):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {"state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                                    for i, s in opt.state_dict()["state"].items()},
                          "param_groups": opt.state_dict()["param_groups"]}}


def _chain(root, links=3, lossy=None, seed=0):
    """A chain root/c0 (full), root/c1 .. c{links} (deltas) of a small MLP
    trained with AdamW; returns (paths, exact states)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    paths, states = [], []
    for k in range(links + 1):
        _train(model, opt, 10, seed * 100 + k)
        st = _state(model, opt)
        p = root / f"c{k}"
        if k == 0:
            ckpt.save(st, p, compress="lossless")
        else:
            ckpt.save(st, p, compress="delta", base=paths[-1], lossy=lossy)
        paths.append(p)
        states.append(st)
    return paths, states


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_chain_keeps_second_moments_and_bounds_the_error(tmp_path):
    paths, states = _chain(tmp_path)
    zeroed, _ = _chain(tmp_path / "zero", lossy={"v_unkept": "zero"})  # the same run, the paper's rule
    got, want, paper = ckpt.load(paths[-1]), states[-1], ckpt.load(zeroed[-1])
    for i in want["optimizer"]["state"]:
        v1, v0 = got["optimizer"]["state"][i]["exp_avg_sq"], want["optimizer"]["state"][i]["exp_avg_sq"]
        if v0.numel() >= 4096:  # lossy: unkept second moments carried from the base, never zeroed
            assert int(((v1 == 0) & (v0 > 0)).sum()) == 0
            assert _rel(v1, v0) < 0.8 * _rel(paper["optimizer"]["state"][i]["exp_avg_sq"], v0)
    info = ckpt.inspect(paths[-1])
    chain = info["shards"][0]["chain"]
    assert [c["file"] for c in chain] == [os.path.join(str(p), "rank0.ebt") for p in reversed(paths)]
    assert chain[-1]["lossy_error"] is None and chain[0]["lossy_error"]["rel_l2"] > 0
    # The loaded state's error is the top link's as recorded at save time (no accumulation along the chain).
    w1, w0 = got["model"]["0.weight"], want["model"]["0.weight"]
    assert float((w1 - w0).abs().max()) <= chain[0]["lossy_error"]["max_abs"] * (1 + 1e-6) + 1e-12


def test_paper_mode_zeroes_unkept_second_moments(tmp_path):
    paths, states = _chain(tmp_path, links=1, lossy={"v_unkept": "zero", "beta": 2.0})
    got, want = ckpt.load(paths[-1]), states[-1]
    v1, v0 = got["optimizer"]["state"][0]["exp_avg_sq"], want["optimizer"]["state"][0]["exp_avg_sq"]
    assert int(((v1 == 0) & (v0 > 0)).sum()) > v0.numel() // 2


def test_moment_masks_are_coded_over_the_weight_mask(tmp_path):
    paths, _ = _chain(tmp_path, links=1, lossy={"beta": 1.0})
    assert ckpt.load(paths[-1])["model"]["0.weight"].shape == (128, 64)
    rows = {t["path"]: t for t in ckpt.inspect(paths[-1])["shards"][0]["tensors"]}
    w_mask = rows["state.model.0.weight.__excp__.mask"]["shape"][0]
    assert w_mask == 128 * 64 // 8
    kept = rows["state.model.0.weight.__excp__.codes"]["shape"][0]  # one code per kept residual
    assert kept < 128 * 64 // 2
    for k in ("exp_avg", "exp_avg_sq"):  # bits only where the weight's residual is kept
        assert rows[f"state.optimizer.state[0].{k}.__excp__.mask"]["shape"][0] == (kept + 7) // 8


def _reference_encoding(w, b, m, v, density=0.1, bits=4, iters=8):
    """The encoding as torch ops, as ebbtide computed it in Python before the
    core did (the oracle of test_core_encoding_matches_the_torch_one): top-k
    weight mask, quantile-started Lloyd codebooks, LSB-first bit masks."""
    def quantise(values, bits):
        k = 1 << bits
        centres = torch.quantile(values, torch.linspace(0.5 / k, 1 - 0.5 / k, k)).contiguous()
        for _ in range(iters):
            centres, _ = torch.sort(centres)
            idx = torch.bucketize(values, (centres[1:] + centres[:-1]) / 2)
            sums = torch.zeros(k).index_add_(0, idx, values)
            counts = torch.zeros(k).index_add_(0, idx, torch.ones_like(values))
            centres = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
        centres, _ = torch.sort(centres)
        return torch.bucketize(values, (centres[1:] + centres[:-1]) / 2).to(torch.uint8), centres

    def pack(mask):
        flat = torch.cat([mask.to(torch.uint8), torch.zeros((-mask.numel()) % 8, dtype=torch.uint8)])
        return (flat.view(-1, 8) * torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)).sum(
            1, dtype=torch.uint8)
    r = w - b
    score = r.abs() * v.sqrt()
    thresh = torch.topk(score, max(1, int(round(density * r.numel()))), sorted=False).values.min()
    mask = score >= thresh if float(thresh) > 0 else score > 0
    out = {"mask": pack(mask)}
    for name, vals, nbits in (("w", r[mask], bits), ("m", m[mask], bits), ("v", v[mask].clamp(min=1e-30).log(), bits)):
        out[name] = quantise(vals, nbits)
    return out


def test_core_encoding_matches_the_torch_one():
    """The C++ encoder (Note [ExCP encoding] in cpp/src/ckpt/excp.cpp) keeps
    exactly the elements torch's top-k keeps, and its codebooks and codes
    are those of the torch encoding up to the rounding of the Lloyd sums
    (it sums in double, by part; torch summed in float32): the same masks
    bitwise, centres within 1e-4 of the value range, all but 0.1% of the
    codes equal."""
    g = torch.Generator().manual_seed(5)
    n = 40000
    b = torch.randn(n, generator=g) * 0.05
    w = b + torch.randn(n, generator=g) * 1e-3 * torch.randn(n, generator=g).exp()
    m = torch.randn(n, generator=g) * 1e-3
    v = (torch.randn(n, generator=g) * 2).exp() * 1e-6
    core, = ckpt.Writer()._native.excp_encode_many(
        [(w.data_ptr(), b.data_ptr(), n, m.data_ptr(), v.data_ptr(), v.data_ptr(), True)], tolerance=0.0)
    ref = _reference_encoding(w, b, m, v)
    assert torch.equal(core["w"]["mask"], ref["mask"])
    assert core["w"]["count"] == core["m"]["count"] == ref["w"][0].numel()
    assert bool(_lossy._unpack_mask(core["m"]["mask"], core["w"]["count"]).all())  # beta 0: m kept with every r
    for name in ("w", "m", "v"):
        codes, book = ref[name]
        span = float(book.max() - book.min())
        assert float((core[name]["codebook"] - book).abs().max()) <= 1e-4 * span, name
        assert int((core[name]["codes"] != codes).sum()) <= codes.numel() // 1000, name


def test_options_are_checked():
    for bad, what in (({"density": 0}, "density"), ({"bits": 9}, "bits"), ({"v_unkept": "x"}, "v_unkept"),
                      ({"tolerance": 1.0}, "tolerance"), ({"dens": 0.1}, "unknown option 'dens'")):
        with pytest.raises(ValueError, match=what):
            _lossy._opts(bad)


def test_bf16_weights_report_the_error_of_what_decodes(tmp_path):
    """The core measures errors in float32; a bf16 weight decodes rounded to
    bf16, and its recorded error is that of what loads."""
    g = torch.Generator().manual_seed(2)
    base = {"w": torch.randn(128, 64, generator=g).bfloat16()}
    st = {"w": (base["w"].float() + 0.01 * torch.randn(128, 64, generator=g)).bfloat16()}
    ckpt.save(base, tmp_path / "b")
    info = ckpt.save(st, tmp_path / "d", compress="delta", base=tmp_path / "b")
    got = ckpt.load(tmp_path / "d")["w"]
    assert got.dtype == torch.bfloat16
    recorded = info["error"]["tensors"]["state.w"]["max_abs"]
    assert 0 < float((got.float() - st["w"].float()).abs().max()) <= recorded * (1 + 1e-6)


def test_encodings_in_batches_equal_one_batch(monkeypatch):
    """Note [ExCP batches]: weights are encoded side by side in batches
    bounded by their float32 copies; however the batches fall, each tensor's
    encoding and error are the same (one weight bf16, so that one job copies
    and the other does not)."""
    from ebbtide import _core
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 3, 0)
    base = _state(model, opt)
    _train(model, opt, 2, 1)
    state = _state(model, opt)
    for st in (state, base):
        st["model"]["0.weight"] = st["model"]["0.weight"].bfloat16()  # encoded from a float32 copy
    w = _core.CkptWriter()
    calls = []
    real = _lossy.encode

    class Counting:
        def excp_encode_many(self, weights, **kw):
            calls.append(len(weights))
            return w.excp_encode_many(weights, **kw)

    whole, whole_report = real(state, base, None, Counting())
    assert calls == [2]  # both weights with their moments (the biases are below min_numel)
    assert len(whole_report["tensors"]) == 6
    monkeypatch.setattr(_lossy, "_BATCH_COPY_BYTES", 1)  # the copying weight ends a batch
    calls.clear()
    split, split_report = real(state, base, None, Counting())
    assert calls == [1, 1]
    assert split_report == whole_report
    flat_whole = dict(_lossy.tree.walk_tensors(whole))
    flat_split = dict(_lossy.tree.walk_tensors(split))
    assert flat_whole.keys() == flat_split.keys()
    for k, t in flat_whole.items():
        assert torch.equal(t, flat_split[k]), k


def test_async_delta_saves_encode_a_staged_copy_after_returning(tmp_path):
    """Note [Async delta saves]: an async delta save that finds the writer's
    staging buffer ready copies the state into it, returns, and encodes on
    a thread; the caller changes the state at once. The chain it writes is
    the chain synchronous saves of the same states write (same encoding,
    ties and all), and a save that finds no buffer encodes in the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = ckpt.Writer()
    states = []
    for k in range(4):
        _train(model, opt, 10, k)
        st = _state(model, opt)
        st["model"]["tied"] = st["model"]["0.weight"]  # a second name for one storage
        states.append(st)
    ckpt.save(states[0], tmp_path / "a0", compress="lossless", writer=w)
    ckpt.save(states[0], tmp_path / "s0", compress="lossless")
    for k in (1, 2, 3):
        live = {"model": dict(states[k]["model"]), "optimizer": states[k]["optimizer"]}
        live["model"] = {n: t.clone() for n, t in live["model"].items()}
        live["model"]["tied"] = live["model"]["0.weight"]
        h = w.save(live, tmp_path / f"a{k}", compress="delta", base=tmp_path / f"a{k - 1}", async_=True)
        assert (h._encoder is not None) == (k > 1), "the first finds no staging buffer and encodes in the call"
        for t in live["model"].values():
            t.add_(1.0)  # the caller goes on at once; the save holds the state at save()
        h.wait()
        w.join()  # the buffer's fill (after the first) and the writes are done
        ckpt.save(states[k], tmp_path / f"s{k}", compress="delta", base=tmp_path / f"s{k - 1}")
    got, want = ckpt.load(tmp_path / "a3"), ckpt.load(tmp_path / "s3")
    for n in want["model"]:
        assert torch.equal(got["model"][n], want["model"][n]), n
    for i in want["optimizer"]["state"]:
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"]["state"][i][m], want["optimizer"]["state"][i][m]), (i, m)


def test_first_async_delta_save_fills_the_staging_buffer_after_its_encode(tmp_path, monkeypatch):
    """Note [Async delta saves]: a save that finds no staging buffer encodes
    in the call, and only then does a thread fill the buffer (beside the
    encode, the fill slowed the call: 1.22-1.61x a synchronous delta save
    against 0.96-1.08x after, 0.5 GB at load 9-12). The encode waits up to
    2 s for a fill to reach its gate, so a fill started before it is seen."""
    import threading

    from ebbtide.checkpoint import dcp_format
    at_gate, seen = threading.Event(), []
    encode = _lossy.encode

    def gate():
        seen.append(len(encoded))
        at_gate.set()

    encoded = []

    def traced(*a, **k):
        at_gate.wait(2)
        out = encode(*a, **k)
        encoded.append(1)
        return out
    monkeypatch.setitem(dcp_format._test_gates, "staging-fill", gate)
    monkeypatch.setattr(_lossy, "encode", traced)
    st = {"w": torch.randn(64, 128)}
    w = ckpt.Writer()
    ckpt.save(st, tmp_path / "b", writer=w)
    h = w.save(st, tmp_path / "c", compress="delta", base=tmp_path / "b", async_=True)
    assert h._encoder is None  # no buffer yet: encoded in the call
    h.wait()
    w.join()
    assert seen == [1], "the staging fill started before the call's encode ended"
    assert w._native.staging_buffer is not None


def test_async_delta_save_errors_come_from_wait(tmp_path):
    st = {"w": torch.randn(64, 128)}
    w = ckpt.Writer()
    ckpt.save(st, tmp_path / "b", writer=w)
    ckpt.save(st, tmp_path / "c0", compress="delta", base=tmp_path / "b", writer=w, async_=True).wait()
    w.join()  # a staging buffer now: the next save encodes on its thread
    h = w.save(st, tmp_path / "c1", compress="delta", base=tmp_path / "missing", async_=True)
    assert h._encoder is not None
    with pytest.raises(FileNotFoundError, match="missing"):
        h.wait()
    assert not os.path.exists(tmp_path / "c1")
    ckpt.save(st, tmp_path / "c1", compress="delta", base=tmp_path / "b", writer=w)  # the writer is free again
    assert ckpt.load(tmp_path / "c1")["w"].shape == (64, 128)


def _flip_data_byte(shard_file):
    """Flips one byte inside the first chunk of tensor data (past the 4 KiB header)."""
    with open(shard_file, "r+b") as f:
        f.seek(4096 + 7)
        b = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([b[0] ^ 0xFF]))


def test_broken_middle_link_is_named(tmp_path):
    paths, _ = _chain(tmp_path)
    middle = os.path.join(str(paths[1]), "rank0.ebt")
    _flip_data_byte(middle)
    with pytest.raises(Exception) as ei:
        ckpt.load(paths[-1])
    assert middle in str(ei.value) or str(paths[1]) in str(ei.value), str(ei.value)
    info = ckpt.inspect(paths[-1])
    bad = [c["file"] for c in info["shards"][0]["chain"] if c["problems"]]
    assert bad == [middle]
    p = subprocess.run([sys.executable, "-m", "ebbtide", "ckpt", "inspect", str(paths[-1])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert f"BAD CHUNK: {middle}:" in p.stderr
    assert "delta chain (4 checkpoints" in p.stdout and "error bound of the loaded state" in p.stdout


def test_missing_base_is_named(tmp_path):
    paths, _ = _chain(tmp_path, links=2)
    shutil.rmtree(paths[0])
    with pytest.raises(FileNotFoundError) as ei:
        ckpt.load(paths[-1])
    msg = str(ei.value)
    assert ei.value.check == "ckpt.delta.base_missing"
    assert str(paths[0]) in msg and str(paths[1]) in msg, msg
    p = subprocess.run([sys.executable, "-m", "ebbtide", "ckpt", "inspect", str(paths[-1])],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and str(paths[0]) in p.stderr


def test_base_from_another_run_is_named(tmp_path):
    paths, _ = _chain(tmp_path, links=2)
    other, _ = _chain(tmp_path / "other", links=0, seed=1)
    shutil.rmtree(paths[1])
    shutil.copytree(other[0], paths[1])  # the path of the middle link now holds another run's checkpoint
    with pytest.raises(ValueError) as ei:
        ckpt.load(paths[-1])
    msg = str(ei.value)
    assert ei.value.check == "ckpt.delta.base_id"
    assert str(paths[1]) in msg and str(paths[2]) in msg, msg


def test_throughput_bench_runs_end_to_end(run_bench):
    pytest.importorskip("transformers")
    p, r = run_bench("excp_bench.py", "--throughput", "tiny", "--rounds", "1", timeout=300)
    for k in ("encode_s", "delta_save_s", "lossless_save_s", "raw_save_s"):
        assert r["median"][k] > 0, k
    assert len(r["async_blocked_s"]["delta"]) == 2 and r["delta_ratio"] > 1
    assert "async saves, caller blocked" in p.stdout


def test_quick_bench_runs_end_to_end(run_bench):
    pytest.importorskip("transformers")
    p, r = run_bench("excp_bench.py", "--quick", timeout=300)
    rows = {x["setting"]: x for x in r["settings"]}
    control = rows["lossless chain (control)"]
    assert control["loss_delta_pct"] == 0.0 and control["state_rel_l2"]["exp_avg"] == 0.0
    d = rows["default (d=0.1 + tolerance, 4/4 bits, v carried)"]
    assert d["delta_ratio_mean"] > 1.5 and len(d["links"]) == r["links"] + 1
    assert "uninterrupted run" in p.stdout
