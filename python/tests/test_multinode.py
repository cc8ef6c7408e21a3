"""Two nodes on this machine: two torchrun agents (--nnodes 2, node ranks 0
and 1) meet at a c10d rendezvous on 127.0.0.1 and run one DDP job (gloo), each
node with its own offload directory (two_nodes.py). Each rank's gradients and
parameters are bitwise those without offloading, each rank offloaded into its
own directory only, and nothing is left in either directory afterwards."""
import os
import socket
import subprocess
import sys
import uuid

import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "two_nodes.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node_rank, port, run_id, node_dir, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
           "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
           "--rdzv_id", run_id, "--rdzv_conf", f"is_host={int(node_rank == 0)}", "--local_addr", "127.0.0.1",
           "--max_restarts", "0", SCRIPT, str(node_dir), str(out_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _files_left(directory):
    return [os.path.join(d, f) for d, _, files in os.walk(directory) for f in files]


def test_two_nodes_each_offload_to_their_own_directory(tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for d in nodes:
        d.mkdir()
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    procs = [_launch(i, port, run_id, nodes[i], tmp_path) for i in range(2)]
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"node {i}: torchrun exited {p.returncode}:\n{out[-4000:]}"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert sorted(r["node_rank"] for r in results) == [0, 1]
    inodes = []
    for r in results:
        rank, node_dir = r["rank"], str(nodes[r["node_rank"]])
        assert r["world_size"] == 2
        assert r["directory"].startswith(node_dir + os.sep)
        diff = [n for n in r["ref_params"] if not torch.equal(r["ref_params"][n], r["params"][n])]
        diff += [f"{n}.grad" for n in r["ref_grads"] if not torch.equal(r["ref_grads"][n], r["grads"][n])]
        assert not diff, f"rank {rank}: differs from the run without offloading: {diff}"
        assert r["steps"] == 3 and r["bytes_offloaded"] > 0, (rank, r["steps"], r["bytes_offloaded"])
        # The slab files are open (and nameless) while the cache lives: each
        # rank's lie in its own directory.
        assert r["files"], f"rank {rank} had no file open under {node_dir} during its steps"
        outside = [path for path, _, _ in r["files"] if not path.startswith(r["directory"] + os.sep)]
        assert not outside, f"rank {rank} had files open outside {r['directory']}: {outside}"
        inodes.append({(dev, ino) for _, dev, ino in r["files"]})
    assert not inodes[0] & inodes[1], "the two ranks shared an offload file"
    # The ranks trained one model together: DDP averaged their gradients.
    assert all(torch.equal(results[0]["params"][n], results[1]["params"][n]) for n in results[0]["params"])
    for d in nodes:
        assert _files_left(d) == [], f"files left behind in {d}"

