"""ebbtide installed as users install it, each time into a fresh virtual
environment that has only torch (docs/packaging.md): `pip install .` with
pip's default build isolation, and the wheel of scripts/build_wheel.sh after
auditwheel's repair. Slow (minutes: they compile and install torch); CI runs
them with the rest (scripts/test.sh); `-m "not slow"` leaves them out."""
import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
NO_ISOLATION_FIX = "pip install --no-build-isolation ."

pytestmark = pytest.mark.slow


def run(args, timeout=600, **kw):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    return p.returncode, p.stdout + p.stderr


def clean_env(**extra):
    """This process's environment without what would leak this venv or build into another."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("SKBUILD_")}
    env.update(extra)
    return env


# What one torch-only venv takes on disk (torch 2.13's CPU wheel and its
# dependencies: about 0.9 GB), with room for a build and pip's unpacking.
VENV_BYTES = 1_500_000_000


def require_disk(where, need=VENV_BYTES):
    free = shutil.disk_usage(where).free
    if free < need:
        pytest.fail(f"{where} has {free / 1e9:.1f} GB free; a fresh venv with torch needs "
                    f"about {need / 1e9:.1f} GB (free space there, or set --basetemp elsewhere)")


@pytest.fixture(scope="module")
def make_venv(tmp_path_factory):
    """make_venv(NAME) -> the python of a new virtual environment with this
    process's torch and nothing else. torch is installed once, into a template
    venv, and each venv is a hard-linked copy of it: the copies cost no space
    until pip writes into them (pip replaces files, never rewrites one in
    place). Two full venvs at once ran CI's disk out (Errno 28, stop 38)."""
    template = tmp_path_factory.mktemp("torch-only") / "venv"
    made = [template]

    def make_template():
        require_disk(template.parent)
        subprocess.run([sys.executable, "-m", "venv", str(template)], check=True, timeout=120)
        py = template / "bin" / "python"
        for pkgs in (["--upgrade", "pip"], [f"torch=={torch.__version__}"]):
            rc, out = run([py, "-m", "pip", "install", "-q", "--no-cache-dir", *pkgs], env=clean_env())
            assert rc == 0, out

    def make(name):
        if not (template / "bin" / "python").exists():
            make_template()
        venv = tmp_path_factory.mktemp(name) / "venv"
        made.append(venv)
        subprocess.run(["cp", "-al", str(template), str(venv)], check=True, timeout=120)
        py = venv / "bin" / "python"
        prefix = run([py, "-c", "import sys; print(sys.prefix)"], env=clean_env())[1].strip()
        assert Path(prefix) == venv, (prefix, venv)  # the copy is a venv of its own
        return py

    yield make
    for venv in reversed(made):
        shutil.rmtree(venv, ignore_errors=True)


@pytest.fixture(scope="module")
def torch_venv(make_venv):
    return make_venv("isolated")


TENSOR_CACHE_WORKS = """
import torch, ebbtide
from ebbtide import _torch
assert _torch.TORCH_VERSION == torch.__version__, (_torch.TORCH_VERSION, torch.__version__)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
x = torch.randn(8, 32)
with ebbtide.offload(model, target="cpu", min_bytes=0, keep_last_modules=0) as cache:
    model(x).sum().backward()
print("tensors offloaded", cache.stats()["tensors_offloaded"], "from", ebbtide.__file__)
"""


def test_pip_install_with_build_isolation_gives_a_working_tensor_cache(torch_venv, tmp_path):
    # Issue 30's contract: a working TensorCache, or a build that stops naming the fix.
    rc, out = run([torch_venv, "-m", "pip", "install", "-v", REPO], cwd=tmp_path,
                  env=clean_env(SKBUILD_BUILD_DIR=str(tmp_path / "build")))
    if rc != 0:
        assert NO_ISOLATION_FIX in " ".join(out.split()), out[-6000:]
        return
    # pip's default isolation runs the build on the venv's own interpreter: the
    # hooks are built against the venv's torch (Note [Finding torch under build isolation]).
    assert "outside the build's isolation" in out, out[-6000:]
    rc, out = run([torch_venv, "-c", TENSOR_CACHE_WORKS], cwd=tmp_path, env=clean_env())
    assert rc == 0, out
    assert f"from {torch_venv.parent.parent}" in out, out


def test_isolation_in_a_separate_venv_stops_naming_no_build_isolation(torch_venv, tmp_path):
    # The isolation of python -m build and uv, which pip has as a feature.
    rc, out = run([torch_venv, "-m", "pip", "install", "--use-feature=venv-isolation", REPO], cwd=tmp_path,
                  env=clean_env(SKBUILD_BUILD_DIR=str(tmp_path / "build")))
    if rc != 0 and "venv-isolation" in out and "invalid choice" in out:
        pytest.skip("this pip has no venv-isolation feature")
    assert rc != 0, out[-6000:]
    flat = " ".join(out.split())
    assert "cannot import torch" in flat and NO_ISOLATION_FIX in flat, out[-6000:]


def system_library_lines(ldd_output, venv):
    """ldd's lines for liburing or libzstd that resolve outside VENV (or not at all)."""
    return [line for line in ldd_output.splitlines()
            if re.search(r"uring|zstd", line) and not line.split("=>")[-1].strip().startswith(str(venv))]


def public_index_env():
    """An environment in which pip sees only its default index, the public one:
    no configuration file (this machine's may add local wheel folders and
    indexes: find-links, extra-index-url) and no PIP_* variable but the
    certificate and the timeout."""
    env = clean_env()
    for k in list(env):
        if k.startswith("PIP_") and k not in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
            del env[k]
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    return env


def requirements(metadata):
    """The wheel's METADATA -> the requirements a plain install takes (no extra)."""
    reqs = [Requirement(v) for k, v in email.parser.HeaderParser().parsestr(metadata).items() if k == "Requires-Dist"]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def public_releases(py, reqs):
    """{name: the newest release on the public index that satisfies REQS'
    specifier}, from `pip index versions` run by PY (which lists what its
    interpreter and platform can install). Fails naming a requirement with none."""
    found = {}
    for req in reqs:
        rc, out = run([py, "-m", "pip", "index", "versions", req.name], env=public_index_env(), timeout=300)
        assert rc == 0, out
        listed = next(line for line in out.splitlines() if line.startswith("Available versions:"))
        versions = [v.strip() for v in listed.split(":", 1)[1].split(",")]
        ok = [v for v in versions if "+" not in v and req.specifier.contains(v, prereleases=True)]
        assert ok, f"no release of {req} on the public index: {listed}"
        found[req.name.lower()] = ok[0]
    return found


def test_the_repaired_wheel_runs_in_a_fresh_venv(make_venv, tmp_path):
    tools = os.environ.get("EBBTIDE_WHEEL_TOOLS")
    env = clean_env(EBBTIDE_VENV=sys.prefix, **({"EBBTIDE_WHEEL_TOOLS": tools} if tools else {}))
    env.update({k: v for k, v in os.environ.items() if k == "SKBUILD_BUILD_DIR"})  # the developer's build folder
    p = subprocess.run(["bash", str(REPO / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=900, env=env)
    out = p.stderr + p.stdout
    assert p.returncode == 0, out[-6000:]
    wheel = Path(p.stdout.strip().splitlines()[-1])  # the script's last line
    assert "manylinux_2_28_x86_64" in wheel.name, wheel.name
    tag = re.search(r'constrains the platform tag to "manylinux_2_(\d+)_x86_64"', " ".join(out.split()))
    assert tag and int(tag.group(1)) <= 28, out[-3000:]  # auditwheel's own reading of the symbol versions

    public = torch.__version__.split("+")[0]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    # liburing and zstd are linked in; torch's libraries come with torch.
    assert not any(re.search(r"ebbtide\.libs/|libtorch|libc10|uring|zstd", n) for n in names), names
    assert f"Requires-Dist: torch=={public}\n" in metadata and "+" not in public, metadata

    py = make_venv("wheel")
    venv = py.parent.parent
    # Where only the public index is reachable, each requirement of the wheel
    # has a release there that this interpreter can install: pip's own listing
    # of the index (no wheel is downloaded; a dry-run install fetched torch's
    # CUDA wheel and cuDNN, 0.9 GB, before CI's disk ran out: Errno 28, stop 47).
    published = public_releases(py, requirements(metadata))
    assert published["torch"] == public, published
    assert set(published) == {"torch", "numpy"}, published

    rc, out = run([py, "-m", "pip", "install", "-q", "--no-cache-dir", wheel, "pytest"], env=clean_env())
    assert rc == 0, out
    site = Path(run([py, "-c", "import ebbtide, os; print(os.path.dirname(ebbtide.__file__))"],
                    cwd=tmp_path, env=clean_env())[1].strip())
    assert site.is_relative_to(venv), site
    modules = sorted(site.glob("*.so"))
    assert [m.name.split(".")[0] for m in modules] == ["_core", "_torch"], modules
    for m in modules:
        rc, out = run(["ldd", m])
        assert rc == 0 and "not found" not in out, out
        assert not system_library_lines(out, venv), f"{m.name} resolves to the system's:\n{out}"

    rc, out = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", REPO / "python" / "tests" / "test_wheel_smoke.py"],
                  cwd=tmp_path, env=clean_env())
    assert rc == 0 and "5 passed" in out, out
    # The demo's packages are an extra the wheel alone does not bring.
    rc, out = run([venv / "bin" / "ebbtide", "demo", "--steps", "1"], cwd=tmp_path, env=clean_env())
    assert rc == 2 and out.strip() == \
        "ebbtide demo: error: needs transformers, which is not installed: pip install 'ebbtide[demo]'", out
