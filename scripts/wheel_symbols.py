"""Refuses a module that imports a symbol no library it names defines.

Usage: python scripts/wheel_symbols.py MODULE.so...   (with the torch the modules were built for)

A symbol that the linker could not bind to a versioned glibc or libstdc++
definition (against glibc 2.28's stubs: Note [manylinux_2_28 without a
container] in python/CMakeLists.txt) is left unversioned and unresolved in a
shared object; the loader would then fail on the user's machine, and
auditwheel does not see it. Allowed unversioned imports: the Python C API
(the interpreter defines it) and what the libraries in torch's lib/ folder
that the module needs export. Weak imports may stay unresolved.
"""
import os
import re
import subprocess
import sys


def dynamic_symbols(path, *flags):
    out = subprocess.run(["nm", "-D", *flags, path], capture_output=True, text=True, check=True).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def needed(path):
    out = subprocess.run(["objdump", "-p", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"^\s*NEEDED\s+(\S+)", out, re.M)


def exported_by(libs):
    names = set()
    for lib in libs:
        for fields in dynamic_symbols(lib, "--defined-only"):
            names.add(fields[-1].split("@")[0])
    return names


def unresolved(module, torch_lib):
    libs = [os.path.join(torch_lib, n) for n in needed(module) if torch_lib and os.path.exists(os.path.join(torch_lib, n))]
    known = exported_by(libs)
    bad = []
    for fields in dynamic_symbols(module, "--undefined-only"):
        kind, name = fields[-2], fields[-1]
        if "@" in name or kind in ("w", "v") or name.startswith(("Py", "_Py")) or name in known:
            continue
        bad.append(name)
    return bad


def main(modules):
    try:
        import torch
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    except ImportError:
        torch_lib = None
    failed = False
    for module in modules:
        bad = unresolved(module, torch_lib)
        if bad:
            failed = True
            print(f"wheel_symbols.py: {os.path.basename(module)} imports {len(bad)} symbol(s) that no library it "
                  f"needs defines (newer than glibc 2.28? define them in python/src/compat/glibc_compat.c): "
                  f"{', '.join(sorted(bad))}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
