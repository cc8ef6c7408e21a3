"""The ebbtide storage engine: asynchronous writes and reads of buffers into
slots of anonymous slab files (O_DIRECT where the filesystem allows, io_uring
when available, striped over several directories).

Example::

    from ebbtide.io import Engine
    with Engine(["/nvme0/ebbtide", "/nvme1/ebbtide"], checksum=True) as eng:
        slot = eng.allocate(len(data))
        eng.write(slot, data).wait()
        out = bytearray(len(data))
        eng.read(slot, out).wait()

``Engine(dirs, backend="auto", chunk_bytes=1 << 20, queue_depth=16,
capacity_bytes=0, checksum=False, direct=True, staging_bytes=64 << 20)``;
EBBTIDE_IO_BACKEND, EBBTIDE_IO_CHUNK_BYTES, EBBTIDE_IO_QUEUE_DEPTH,
EBBTIDE_IO_CHECKSUM and EBBTIDE_IO_DIRECT override the arguments.

``write(slot, buffer)`` / ``read(slot, buffer)`` take any C-contiguous object
with the buffer protocol (bytes, bytearray, memoryview, numpy arrays; reads
need a writable one) and keep it referenced until the request is done.
``write_ptr(slot, ptr, nbytes, device=False, stream=0)`` and ``read_ptr`` take
raw addresses (e.g. ``tensor.data_ptr()``); the caller keeps that memory alive
until the request is done. Both return a ``Request`` with ``wait()`` (releases
the GIL), ``done()``, ``ok()``, ``cancelled()``.
"""
from ebbtide._core import ChecksumError as _ChecksumError
from ebbtide._core import Engine as _Engine
from ebbtide._core import IoError as _IoError
from ebbtide._core import Request as _Request
from ebbtide._core import StateError as _StateError
from ebbtide._core import bench_io as _bench_io

Engine = _Engine
Request = _Request

IoError = _IoError
IoError.__doc__ = ("An I/O or system call failed (OSError subclass): errno, filename and offset "
                   "name the cause, e.g. ENOENT for a missing directory, ENOSPC for a full disk.")
ChecksumError = _ChecksumError
ChecksumError.__doc__ = ("Data read back failed its crc32c checksum (IoError subclass, errno EIO); "
                         "the read request failed, so the buffer must not be used.")
StateError = _StateError
StateError.__doc__ = ("An operation is not valid in the slot's or engine's state (RuntimeError "
                      "subclass): slot freed twice, read of a slot never written, closed engine, "
                      "cancelled request.")


def bench_io(dirs, size, chunk=1 << 20, qd=16, backend="auto", request=64 << 20, checksum=False,
             device=True, verify=True, huge_pages=True):
    """Writes then reads back ``size`` bytes through the engine; returns a dict of
    GB/s (10^9 bytes/s), seconds, the backend, whether O_DIRECT was used, whether
    the data verified and whether the buffers got huge pages (``huge_pages``)."""
    return _bench_io(dirs, size, chunk, qd, backend, request, checksum, device, verify, huge_pages)


__all__ = ["Engine", "Request", "IoError", "ChecksumError", "StateError", "bench_io"]
