"""Two gloo ranks train a 4-block net under FSDP2 or DDP (argv[3]) with and
without an ebbtide budget plan forcing keep/offload/recompute/recompute_offload
per block; each rank writes "<bitwise 0|1> <blocks recomputed>" to
<out>.<rank>. Run by test_cache_budget.py::test_data_parallel_on_gloo_bitwise."""
import os, sys, tempfile
import torch, torch.distributed as dist
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cache_budget import make_net, run, force, PLACEMENT_SETS
import ebbtide

def main(rank, world, init, out, mode):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    def sharded():
        m = make_net(layers=4)
        if mode == "ddp":
            return torch.nn.parallel.DistributedDataParallel(m)
        from torch.distributed.fsdp import fully_shard
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
        return m
    torch.manual_seed(rank)
    x = torch.randn(32, 128)
    ref = run(sharded(), x)
    class MP:  # a monkeypatch for force()
        def setattr(self, obj, name, value): setattr(obj, name, value)
    force(MP(), PLACEMENT_SETS["mix"])
    model = sharded()
    with tempfile.TemporaryDirectory() as tmp, \
            ebbtide.TensorCache("ssd", tmp, min_bytes=0, keep_last_modules=0,
                                activation_budget_bytes=1 << 40).attach(model) as cache:
        got = run(model, x, cache)
        rec = cache.stats()["recomputed_blocks"]
    # Each rank compares its own shards: no collective here, so a rank that
    # differs cannot leave the other waiting in one.
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    diff = [f"step {s} grad {i}" for s, (ga, gb) in enumerate(zip(got, ref))
            for i, (a, b) in enumerate(zip(ga, gb)) if not torch.equal(local(a), local(b))]
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{int(not diff)} {len(rec)} {';'.join(diff)}")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    init, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.spawn(main, args=(2, init, out, mode), nprocs=2)
