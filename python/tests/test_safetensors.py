"""safetensors files through ebbtide (docs/checkpoints.md, "safetensors"):
bitwise round trips in both directions with the safetensors package, HF
save_pretrained checkpoints (single and sharded), and hostile files, which
must raise a typed error naming the file and never crash or hang."""
import errno
import json
import os
import random

import pytest
import torch

from ebbtide import checkpoint as ckpt

st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

TYPED = (ValueError, OSError, NotImplementedError)

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64]
_DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
            if hasattr(torch, n)]


def _bits(t):
    """The tensor's bytes (any dtype, 0-d included), for bitwise comparison."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _tensors(seed=0):
    """Every dtype in a 0-d, an empty, a small and (f32) a >1 MiB tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for dt in _DTYPES:
        name = str(dt).replace("torch.", "")
        for shape in ((), (0, 3), (3, 5)):
            raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dt.itemsize,), dtype=torch.uint8,
                                generator=g)
            if dt == torch.bool:
                raw = raw % 2
            n = torch.Size(shape).numel()
            out[f"{name}.{len(shape)}d{n}"] = raw[:n * dt.itemsize].view(dt).reshape(shape).clone()
    out["big.f32"] = torch.randn(513, 1031, generator=g)          # in place (>= 1 MiB)
    out["big.bf16"] = torch.randn(1 << 20, generator=g).bfloat16()  # 2 MiB
    out["ragged.i8"] = torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=g)[:(4 << 20) - 3].clone()
    return out


@pytest.mark.parametrize("direct", ["1", "0"])
def test_round_trip_with_the_safetensors_package(tmp_path, monkeypatch, direct):
    monkeypatch.setenv("EBBTIDE_CKPT_DIRECT", direct)
    t = _tensors()
    meta = {"format": "pt", "note": "quote \" backslash \\ é"}
    info = ckpt.save_safetensors(t, tmp_path / "ebb.safetensors", metadata=meta)
    assert info["file_bytes"] == os.path.getsize(tmp_path / "ebb.safetensors")
    if direct == "0":
        assert "buffered" in info["backend"]
    _same(st.load_file(tmp_path / "ebb.safetensors"), t)
    with safe_open(tmp_path / "ebb.safetensors", "pt") as f:
        assert f.metadata() == meta
    st.save_file(t, tmp_path / "ref.safetensors", metadata=meta)
    _same(ckpt.load_safetensors(tmp_path / "ref.safetensors"), t)
    _same(ckpt.load_safetensors(tmp_path / "ebb.safetensors"), t)
    assert sorted(os.listdir(tmp_path)) == ["ebb.safetensors", "ref.safetensors"]  # no temporary left


def test_loaded_tensors_are_independent_and_writable(tmp_path):
    t = {"a": torch.randn(600, 600), "b": torch.randn(600, 600), "c": torch.arange(7)}
    ckpt.save_safetensors(t, tmp_path / "m.safetensors")
    u = ckpt.load_safetensors(tmp_path / "m.safetensors")
    for k in t:
        assert u[k].is_contiguous()
        assert u[k].untyped_storage().nbytes() == t[k].numel() * t[k].element_size()
    u["a"].add_(1)
    assert torch.equal(u["b"], t["b"]) and torch.equal(u["a"], t["a"] + 1)


def test_save_takes_views_and_overwrites_atomically(tmp_path):
    base = torch.randn(64, 64)
    t = {"t": base.t(), "slice": base[3:9, ::2], "neg": base[:2].neg().conj()}
    p = tmp_path / "v.safetensors"
    p.write_bytes(b"old")
    ckpt.save_safetensors(t, p)
    _same(st.load_file(p), {k: v.contiguous() for k, v in t.items()})
    assert os.listdir(tmp_path) == ["v.safetensors"]


def test_save_refuses_what_the_format_cannot_hold(tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="dict"):
        ckpt.save_safetensors([torch.ones(1)], p)
    with pytest.raises(TypeError, match="'a' is a list"):
        ckpt.save_safetensors({"a": [1]}, p)
    with pytest.raises(TypeError, match="metadata"):
        ckpt.save_safetensors({"a": torch.ones(1)}, p, metadata={"k": 1})
    with pytest.raises(ValueError, match="'a' has dtype torch.complex128"):
        ckpt.save_safetensors({"a": torch.ones(1, dtype=torch.complex128)}, p)
    with pytest.raises(ValueError, match="reserved"):
        ckpt.save_safetensors({"__metadata__": torch.ones(1)}, p)
    with pytest.raises(ValueError, match="only dense"):
        ckpt.save_safetensors({"s": torch.eye(3).to_sparse()}, p)
    with pytest.raises(OSError, match="cannot create the safetensors file: no such directory"):
        ckpt.save_safetensors({"a": torch.ones(1)}, tmp_path / "no" / "dir.safetensors")
    assert os.listdir(tmp_path) == []
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match="the path is a directory") as ei:  # before writing anything
        ckpt.save_safetensors({"a": torch.ones(1 << 20)}, tmp_path / "d")
    assert ei.value.filename == str(tmp_path / "d")
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == []


def test_missing_files_and_devices_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors file does not exist"):
        ckpt.load_safetensors(tmp_path / "missing.safetensors")
    if not torch.cuda.is_available():
        ckpt.save_safetensors({"a": torch.ones(1)}, tmp_path / "x.safetensors")
        with pytest.raises(RuntimeError, match="device 'cuda' asked for, but torch sees no CUDA device"):
            ckpt.load_safetensors(tmp_path / "x.safetensors", device="cuda")


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_save_pretrained_loads_bitwise(tmp_path):
    model = _tiny_llama()
    want = {k: v for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "single")
    assert os.path.exists(tmp_path / "single" / "model.safetensors")
    _same(ckpt.load_safetensors(tmp_path / "single"), want)

    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    assert index.exists()
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 2
    _same(ckpt.load_safetensors(tmp_path / "sharded"), want)
    _same(ckpt.load_safetensors(index), want)

    # And back: a state dict saved by ebbtide loads into a fresh model with from_pretrained's reader.
    ckpt.save_safetensors(want, tmp_path / "single" / "model.safetensors", metadata={"format": "pt"})
    again = type(model).from_pretrained(tmp_path / "single")
    _same(again.state_dict(), want)


# Note [Loading into existing tensors]: into= a module (single and sharded
# save_pretrained, tied embeddings stored once) or a dict, in place, bitwise;
# the same errors as load_state_dict's, raised before anything is read.
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_load_into_a_model_in_place(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tie)
    src = transformers.LlamaForCausalLM(cfg)
    src.save_pretrained(tmp_path / "single")
    src.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    for where in ("single", "sharded"):
        torch.manual_seed(1)
        dst = transformers.LlamaForCausalLM(cfg)
        ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
        versions = {k: v._version for k, v in dst.state_dict().items()}
        res = ckpt.load_safetensors(tmp_path / where, into=dst)
        assert res.missing_keys == [] and res.unexpected_keys == []
        _same(dst.state_dict(), src.state_dict())
        assert {k: v.data_ptr() for k, v in dst.state_dict().items()} == ptrs  # in place
        assert all(v._version > versions[k] for k, v in dst.state_dict().items() if v.numel())
        if tie:
            assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def test_load_into_checks_names_dtypes_and_shapes_before_reading(tmp_path):
    g = torch.Generator().manual_seed(5)
    saved = {"a": torch.randn(64, 1024, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
             "c": torch.arange(6, dtype=torch.int32)}
    ckpt.save_safetensors(saved, tmp_path / "f.safetensors")
    f = tmp_path / "f.safetensors"

    def fresh(**over):
        d = {"a": torch.zeros(64, 1024), "b": torch.zeros(3, dtype=torch.bfloat16),
             "c": torch.zeros(6, dtype=torch.int32)}
        d.update(over)
        return d
    for bad, match in ((fresh(b=torch.zeros(3)), r"tensor 'b' is BF16 \[3\], its target torch.float32 \[3\]"),
                       (fresh(a=torch.zeros(64, 1023)), r"tensor 'a' is F32 \[64, 1024\], its target"),
                       (fresh(extra=torch.zeros(2)), r"missing from the file: 'extra'"),
                       ({k: v for k, v in fresh().items() if k != "c"}, r"in the file but not in the targets: 'c'"),
                       (fresh(c=torch.zeros(6, dtype=torch.int32, device="meta")), r"its target is on meta")):
        before = {k: v.clone() for k, v in bad.items() if v.device.type != "meta"}
        with pytest.raises(ValueError, match=match):
            ckpt.load_safetensors(f, into=bad)
        for k, v in before.items():  # nothing was loaded
            assert torch.equal(bad[k], v), k
    # strict=False loads what both have and says what it left.
    part = {"a": torch.zeros(64, 1024), "extra": torch.zeros(2)}
    res = ckpt.load_safetensors(f, into=part, strict=False)
    assert res.missing_keys == ["extra"] and sorted(res.unexpected_keys) == ["b", "c"]
    assert torch.equal(part["a"], saved["a"]) and not part["extra"].any()
    # A non-contiguous target gets the values through a copy.
    t = torch.zeros(1024, 64).t()
    ckpt.load_safetensors(f, into={"a": t, "b": torch.zeros(3, dtype=torch.bfloat16),
                                   "c": torch.zeros(6, dtype=torch.int32)})
    assert torch.equal(t, saved["a"])
    with pytest.raises(ValueError, match="not both"):
        ckpt.load_safetensors(f, device="cpu", into=fresh())
    with pytest.raises(TypeError, match="into must be a module or a dict"):
        ckpt.load_safetensors(f, into=[1])


def _index_dir(tmp_path):
    d = tmp_path / "idx"
    d.mkdir()
    a, b = {"x": torch.randn(4), "y": torch.arange(3)}, {"z": torch.ones(2, 2)}
    st.save_file(a, d / "part-1.safetensors")
    st.save_file(b, d / "part-2.safetensors")
    wm = {"x": "part-1.safetensors", "y": "part-1.safetensors", "z": "part-2.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d, wm, {**a, **b}


def test_index_must_match_its_files(tmp_path):
    d, wm, want = _index_dir(tmp_path)
    _same(ckpt.load_safetensors(d), want)
    ip = d / "model.safetensors.index.json"
    cases = [
        ({**wm, "w": "part-2.safetensors"}, "tensor 'w' \\(mapped to this file by .*\\) is not in it"),
        ({k: v for k, v in wm.items() if k != "y"}, "tensor 'y' is in this file but .* does not map it here"),
        ({**wm, "x": "../part-1.safetensors"}, "not a file name in the index's directory"),
        ({**wm, "x": "/etc/passwd"}, "not a file name"),
        ({**wm, "x": 3}, "not a file name"),
    ]
    for bad_wm, pattern in cases:
        ip.write_text(json.dumps({"weight_map": bad_wm}))
        with pytest.raises(ValueError, match=pattern):
            ckpt.load_safetensors(d)
    ip.write_text('{"weight_map": {"x": "part-1.safetensors", "x": "part-2.safetensors"}}')
    with pytest.raises(ValueError, match="'x' appears twice"):
        ckpt.load_safetensors(ip)
    ip.write_text('{"weight_map": [}')
    with pytest.raises(ValueError, match="corrupt safetensors index"):
        ckpt.load_safetensors(ip)
    ip.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="no weight_map"):
        ckpt.load_safetensors(ip)


def test_special_files_are_refused(tmp_path):
    good = tmp_path / "good.safetensors"
    st.save_file({"a": torch.ones(3)}, good)
    os.symlink(good, tmp_path / "link.safetensors")
    with pytest.raises(ValueError, match="symbolic link"):
        ckpt.load_safetensors(tmp_path / "link.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(ValueError, match="FIFO"):
        ckpt.load_safetensors(tmp_path / "fifo.safetensors")
    with pytest.raises(OSError) as e:
        ckpt.load_safetensors(tmp_path / "missing.safetensors")
    assert e.value.errno == errno.ENOENT
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        ckpt.load_safetensors(_empty_dir(tmp_path))


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def _header_file(path, header, data=b""):
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)
    return path


def test_crafted_headers_name_the_file_and_tensor(tmp_path):
    p = tmp_path / "c.safetensors"
    cases = [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "tensor 'w': shape \\[2\\]"),
        ({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "tensor 'w': unknown dtype 'Q7'"),
        ({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
          "v": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6, "overlaps tensor 'w'"),
        ({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 9, "belong to no tensor"),
        ({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 2, "run past the data section"),
        ({"w": {"dtype": "U8", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 4]}}, b"\0" * 4, "does not take"),
        ({"__metadata__": {"k": 5}}, b"", "__metadata__ value of 'k' is not a string"),
    ]
    for header, data, pattern in cases:
        _header_file(p, header, data)
        with pytest.raises(ValueError, match=pattern) as e:
            ckpt.load_safetensors(p)
        assert str(p) in str(e.value)
    _header_file(p, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(NotImplementedError, match="dtype F4"):
        ckpt.load_safetensors(p)


def test_random_mutations_raise_typed_errors_and_never_load_what_safetensors_refuses(tmp_path):
    """Seeded byte mutations of a valid file: ebbtide loads it or raises a
    typed error naming it. ebbtide is never laxer than the safetensors package:
    what it loads, safetensors loads too, to the same bytes."""
    p = tmp_path / "m.safetensors"
    st.save_file({"layer.0.weight": torch.randn(40, 3), "bias": torch.arange(5, dtype=torch.int16),
                  "flag": torch.tensor(True)}, p, metadata={"format": "pt"})
    good = p.read_bytes()
    rng = random.Random(20261123)
    loaded = refused = 0
    for i in range(400):
        m = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(min(len(m), 8 + 220)) if rng.random() < 0.85 else rng.randrange(len(m))
            op = rng.random()
            if op < 0.4:
                m[at] = rng.randrange(256)
            elif op < 0.7:
                m[at] = ord(rng.choice('{}[],:"0123456789-.eE\\ u'))
            elif op < 0.85:
                del m[at:at + rng.randint(1, 4)]
            else:
                del m[rng.randrange(len(m) + 1):]
        f = tmp_path / f"mut{i % 3}.safetensors"
        f.write_bytes(bytes(m))
        try:
            got = ckpt.load_safetensors(f)
        except TYPED as e:
            assert str(f) in str(e), e
            refused += 1
            continue
        loaded += 1
        try:
            ref = st.load_file(f)
        except Exception as e:  # noqa: BLE001 - the package refusing what ebbtide loaded is the failure
            pytest.fail(f"mutation {i}: ebbtide loaded a file the safetensors package refuses ({e})")
        _same(got, ref)
    assert refused > 200 and loaded > 0


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(capsys, *args):
    from ebbtide import cli
    rc = cli.main(["ckpt", "inspect", *map(str, args)])
    out = capsys.readouterr()
    return _Run(rc, out.out, out.err)


def test_cli_inspect(tmp_path, capsys):
    p = tmp_path / "m.safetensors"
    ckpt.save_safetensors({"emb.weight": torch.randn(10, 4), "step": torch.tensor(3)}, p, {"format": "pt"})
    r = _cli(capsys, p)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.split()[:3] == ["emb.weight", "F32", "10x4"] for ln in lines), r.stdout
    assert any(ln.split()[:3] == ["step", "I64", "()"] for ln in lines), r.stdout
    d, wm, _ = _index_dir(tmp_path)
    r = _cli(capsys, d)
    assert r.returncode == 0 and "part-2.safetensors" in r.stdout and "index of 2 file(s)" in r.stdout, r.stdout
    (d / "part-2.safetensors").write_bytes(p.read_bytes()[:50])
    r = _cli(capsys, d / "model.safetensors.index.json")
    assert r.returncode == 1
    bad = [ln for ln in r.stderr.splitlines() if ln.startswith("BAD FILE:")]
    assert len(bad) == 1 and "part-2.safetensors" in bad[0] and "runs past the end of the file" in bad[0], r.stderr
    (tmp_path / "empty").mkdir()
    r = _cli(capsys, tmp_path / "empty")  # no format's files: all three are named
    assert r.returncode == 2 and "not a checkpoint in a format this reads" in r.stderr, r.stderr
    assert all(f in r.stderr for f in ("index.json", ".metadata", "model.safetensors.index.json")), r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_path):
    t = {k: v.cuda() for k, v in _tensors().items()}
    ckpt.save_safetensors(t, tmp_path / "g.safetensors")
    _same({k: v.cpu() for k, v in st.load_file(tmp_path / "g.safetensors").items()},
          {k: v.cpu() for k, v in t.items()})
    u = ckpt.load_safetensors(tmp_path / "g.safetensors", device="cuda")
    assert all(v.is_cuda for v in u.values())
    _same({k: v.cpu() for k, v in u.items()}, {k: v.cpu() for k, v in t.items()})
    into = {k: torch.zeros_like(v) for k, v in t.items()}  # Note [Loading into existing tensors], on the GPU
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    ckpt.load_safetensors(tmp_path / "g.safetensors", into=into)
    assert {k: v.data_ptr() for k, v in into.items()} == ptrs
    _same({k: v.cpu() for k, v in into.items()}, {k: v.cpu() for k, v in t.items()})
