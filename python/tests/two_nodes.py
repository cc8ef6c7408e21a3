"""Run by test_multinode.py: one rank of a torchrun job of 2 nodes on this
machine, each node with its own offload directory NODE_DIR (its "SSD").

    torchrun --nnodes 2 --node_rank I --nproc_per_node 1 --rdzv_backend c10d \
        --rdzv_endpoint 127.0.0.1:PORT --rdzv_id ID two_nodes.py NODE_DIR OUT_DIR

The rank trains a small MLP under DDP (gloo) for 3 steps, first without
offloading and then with a TensorCache (target="ssd") in NODE_DIR/rank<LOCAL_RANK>,
and saves to OUT_DIR/rank<RANK>.pt both runs' last gradients and final
parameters, its cache's statistics and the files its process had open under
NODE_DIR during the step (the slab files have no name: /proc/self/fd is where
they show).
"""
import os
import sys

import torch

WIDTH = 64
BLOCKS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                                     torch.nn.Linear(4 * WIDTH, WIDTH))
                                 for _ in range(BLOCKS)))


def _open_files_under(root):
    """(path, device, inode) of every file this process has open under `root`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith(root + os.sep):
            found.append((target, st.st_dev, st.st_ino))
    return found


def run(rank, directory=None, node_dir=None):
    """3 DDP steps (batches of 8 rows, different per rank); with `directory`, under an ssd TensorCache there."""
    import torch.distributed as dist

    import ebbtide

    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(3, 8, WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    cache = None
    if directory is not None:
        cache = ebbtide.TensorCache(target="ssd", path=directory, min_bytes=0, keep_last_modules=0).attach(model)
    files = []
    grads = None
    for x in data:
        with cache.step() if cache is not None else torch.enable_grad():
            loss = ddp(x).square().mean()
            if cache is not None:
                cache.drain()  # every store done before backward: offloaded bytes do not depend on timing
                files.extend(_open_files_under(node_dir))
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = None
    if cache is not None:
        stats = cache.stats()
        cache.close()
    dist.barrier()
    return grads, params, stats, files


def main():
    import torch.distributed as dist

    node_dir, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory = os.path.join(node_dir, f"rank{os.environ['LOCAL_RANK']}")
    os.makedirs(directory, exist_ok=True)
    ref_grads, ref_params, _, _ = run(rank)
    grads, params, stats, files = run(rank, directory, node_dir)
    torch.save(dict(rank=rank, world_size=dist.get_world_size(), node_rank=int(os.environ["GROUP_RANK"]),
                    directory=directory, ref_grads=ref_grads, ref_params=ref_params, grads=grads, params=params,
                    steps=stats["steps"], bytes_offloaded=stats["total"]["bytes_offloaded"], files=files),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
