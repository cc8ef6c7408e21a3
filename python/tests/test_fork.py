"""Note [Objects across fork] (cpp/include/ebbtide/mem/fork_origin.hpp): a
process that forks while ebbtide objects await collection (a DataLoader's
workers, a multiprocessing.Manager's server) must not run their destructors
in the child: those join threads and wait on conditions the child does not
have (before the fix: SIGSEGV for the tensor cache, a hang for the checkpoint
writer). Nor may the child's own caches and saves use the parent's pooled
stores or default writer. Each case runs in its own interpreter, which makes
the objects, drops them into a reference cycle, forks, and collects in the
child; the parent then checks that its own objects still work."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, os, sys, time
    import torch, ebbtide
    from ebbtide import _core, checkpoint as ckpt
    kind, mode, d = sys.argv[1], sys.argv[2], sys.argv[3]
    # torch's own OpenMP pool hangs a forked child's next parallel op (why a
    # DataLoader worker runs one thread): one thread here too.
    torch.set_num_threads(1)

    def sub(name):
        path = os.path.join(d, name)
        os.makedirs(path, exist_ok=True)
        return path

    class Cycle:
        pass

    def step(cache):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        x = torch.randn(16, 64)
        model(x).sum().backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        cache.attach(model)
        with cache.step():
            model(x).sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
        # Whether a store ran before backward is timing (Note [Late stores]); errors are not.
        stats = cache.stats()
        assert stats["tensors_saved"] == 3 and stats["store_failures"] == 0 and stats["load_failures"] == 0, stats

    def make():
        if kind == "cache":
            cache = ebbtide.TensorCache("ssd", sub("cache"), min_bytes=0, keep_last_modules=0)
            step(cache)
            return cache
        if kind == "writer":
            w = ckpt.Writer()
            w.save({"w": torch.randn(1000)}, os.path.join(d, "w"))
            return w
        if kind == "async":  # the module's default writer, which its exit hook waits for
            h = ckpt.save({"w": torch.randn(1000)}, os.path.join(d, "a"), async_=True)
            h.wait()
            return h
        if kind == "readers":
            ckpt.save({"w": torch.randn(1000)}, os.path.join(d, "r"))
            ckpt.save_safetensors({"w": torch.randn(1000)}, os.path.join(d, "s.safetensors"))
            shard = next(f for f in os.listdir(os.path.join(d, "r")) if f.endswith(".ebt"))
            return [_core.CkptReader(os.path.join(d, "r", shard)),
                    _core.SafetensorsReader(os.path.join(d, "s.safetensors")),
                    _core.Engine([sub("engine")], capacity_bytes=4 << 20)]
        raise SystemExit(f"unknown kind {kind}")

    gc.disable()  # the cycle below must reach the child uncollected
    keep = ebbtide.TensorCache("ssd", sub("keep"), min_bytes=0, keep_last_modules=0)
    with ebbtide.offload(torch.nn.Linear(8, 8), "ssd", sub("pooled")):
        pass  # a store goes to the process's pool
    c = Cycle()
    c.obj, c.me = make(), c
    del c
    pid = os.fork()
    if pid == 0:
        if gc.collect() == 0:  # the parent's garbage, collected here
            os._exit(5)
        if mode == "exit":
            sys.exit(0)  # the interpreter's own exit: atexit hooks, finalization
        try:
            keep.close()
            os._exit(3)
        except RuntimeError as e:
            if "forked child" not in str(e):
                os._exit(4)
        if mode == "own":
            # What the child makes is its own: a cache (not the parent's pooled
            # store), an offloaded step, a checkpoint (not the parent's default writer).
            mine = ebbtide.TensorCache("ssd", sub("child"), min_bytes=0, keep_last_modules=0)
            step(mine)
            mine.close()
            with ebbtide.offload(torch.nn.Linear(8, 8), "ssd", sub("pooled")):
                pass
            ckpt.save({"w": torch.ones(10)}, os.path.join(d, "child-ckpt"), async_=True).wait()
            assert torch.equal(ckpt.load(os.path.join(d, "child-ckpt"))["w"], torch.ones(10))
        os._exit(0)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
            sys.exit(1)
        time.sleep(0.05)
    print("child", "signal %d" % os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exit %d" % os.WEXITSTATUS(status))
    # The parent's objects are untouched.
    gc.enable()
    gc.collect()
    step(keep)
    keep.close()
    ckpt.save({"w": torch.zeros(10)}, os.path.join(d, "parent-ckpt"), async_=True).wait()
    print("parent ok")
""")


@pytest.mark.parametrize("kind,mode", [("cache", "collect"), ("writer", "collect"), ("async", "collect"),
                                       ("readers", "collect"), ("async", "exit"), ("cache", "own")])
def test_a_forked_child_leaves_the_parents_objects_alone(kind, mode, tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT, kind, mode, str(tmp_path)], capture_output=True, text=True,
                       timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "child exit 0" in out and "parent ok" in out, out[-4000:]
    # What the child drops without its destructor is not a leak nanobind reports.
    assert "leaked" not in out, out[-4000:]
