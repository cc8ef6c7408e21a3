"""The storage engine from Python: round trips, errors as typed exceptions,
and a small benchmark run."""
import errno
import os
import pickle

import pytest

from ebbtide import io


@pytest.fixture(params=["uring", "posix"])
def engine(request, tmp_path):
    try:
        eng = io.Engine([str(tmp_path)], backend=request.param, chunk_bytes=256 << 10,
                        queue_depth=4, checksum=True, staging_bytes=4 << 20)
    except NotImplementedError as e:
        pytest.skip(str(e))
    yield eng
    eng.close()


def test_round_trip_bytes_bytearray_memoryview(engine):
    data = os.urandom(3 * 256 * 1024 + 17)
    slot = engine.allocate(len(data))
    req = engine.write(slot, data)
    req.wait()
    assert req.done() and req.ok() and not req.cancelled()
    out = bytearray(len(data))
    engine.read(slot, out).wait()
    assert bytes(out) == data
    view = memoryview(bytearray(len(data)))
    engine.read(slot, view).wait()
    assert view.tobytes() == data
    s = engine.stats()
    assert s["writes"] == 1 and s["reads"] == 2 and s["bytes_stored"] == len(data)
    assert s["backend"] == engine.backend
    assert engine.backend in engine.describe()
    engine.free(slot)
    assert engine.stats()["slots_live"] == 0


def test_round_trip_numpy_and_raw_pointers(engine):
    np = pytest.importorskip("numpy")
    a = np.arange(100_000, dtype=np.float32)
    slot = engine.allocate(a.nbytes)
    engine.write(slot, a).wait()
    b = np.zeros_like(a)
    engine.read(slot, b).wait()
    assert (a == b).all()
    c = np.zeros_like(a)
    engine.read_ptr(slot, c.ctypes.data, c.nbytes).wait()
    assert (a == c).all()
    d = a * 2
    engine.write_ptr(slot, d.ctypes.data, d.nbytes).wait()
    engine.read(slot, b).wait()
    assert (b == d).all()
    with pytest.raises(NotImplementedError):
        engine.write_ptr(slot, d.ctypes.data, d.nbytes, device=True)


def test_buffers_kept_alive_until_done(engine):
    slot = engine.allocate(1 << 20)
    engine.write(slot, os.urandom(1 << 20))  # the temporary bytes object must survive
    engine.drain()
    assert engine._held_buffers() == 0
    out = bytearray(1 << 20)
    engine.read(slot, out).wait()


def test_errors_are_typed(engine, tmp_path):
    with pytest.raises(FileNotFoundError) as e:  # the errno's builtin class too (Note [Errno subclasses])
        io.Engine([str(tmp_path / "missing")])
    assert e.value.errno == errno.ENOENT
    assert isinstance(e.value, io.IoError)
    assert "missing" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))  # DCP's checkpoint process sends errors back pickled
    assert type(again) is type(e.value) and again.errno == errno.ENOENT and str(again) == str(e.value)
    with pytest.raises(ValueError):
        engine.allocate(0)
    slot = engine.allocate(10)
    with pytest.raises(io.StateError):
        engine.read(slot, bytearray(10))  # never written
    with pytest.raises(ValueError):
        engine.write(slot, b"x" * 8192)  # larger than the slot
    with pytest.raises(ValueError):
        engine.read(slot, b"immutable!")  # not writable
    engine.free(slot)
    with pytest.raises(io.StateError):
        engine.free(slot)
    assert issubclass(io.ChecksumError, OSError)
    assert issubclass(io.StateError, RuntimeError)
    with pytest.raises(ValueError):
        io.Engine([str(tmp_path)], backend="spdk")


def test_cancel_and_close(tmp_path):
    eng = io.Engine([str(tmp_path)], backend="posix", queue_depth=1, chunk_bytes=1 << 20)
    data = bytes(4 << 20)
    reqs = [eng.write(eng.allocate(len(data)), data) for _ in range(16)]
    assert eng.cancel(reqs[-1])
    with pytest.raises(io.StateError):
        reqs[-1].wait()
    assert reqs[-1].cancelled()
    eng.drain()
    assert all(r.ok() for r in reqs[:-1])
    eng.close()
    assert eng.closed()
    with pytest.raises(io.StateError):
        eng.allocate(1)


def test_bench_io_small_run(tmp_path):
    r = io.bench_io([str(tmp_path)], 8 << 20, chunk=256 << 10, qd=4, request=2 << 20)
    for key in ("backend", "describe", "bytes", "write_gbps", "read_gbps", "write_seconds",
                "read_seconds", "device_measured", "device_write_gbps", "device_read_gbps",
                "direct", "verified"):
        assert key in r
    assert r["bytes"] == 8 << 20
    assert r["verified"] is True
    assert r["write_gbps"] > 0 and r["read_gbps"] > 0
    assert list(tmp_path.iterdir()) == []
