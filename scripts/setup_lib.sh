# Steps shared by scripts/setup.sh (everything the tests need) and
# scripts/demo.sh (only what `ebbtide demo` needs); sourced, not run. Each
# step is skipped when already done. Needs $repo, $venv and $torch_req.

say() { printf '\033[1m[%s]\033[0m %s\n' "${say_tag:-setup}" "$*"; }

# Installs the Debian packages named that are missing (as root, with apt-get);
# elsewhere warns naming them.
ensure_system_packages() {
  local need=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
  done
  ((${#need[@]})) || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    say "WARNING: missing system packages ${need[*]} and not root: install them with apt-get" >&2
  fi
}

# The virtual environment with torch ($torch_req unless torch imports there).
ensure_venv_with_torch() {
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
  fi
  py="$venv/bin/python"
  if ! "$py" -c "import torch" 2>/dev/null; then
    say "installing $torch_req"
    "$py" -m pip install -q "$torch_req"
  fi
}

# Installs the requirement files named (relative to the repo) unless the venv
# has them as they are now; the installed torch is a constraint: no
# requirement may replace it. Extra arguments after -- run as pip installs
# of their own (with --no-deps), e.g. packages whose pins must be ignored.
ensure_requirements() {
  local files=() extra=() f
  while (($#)) && [ "$1" != -- ]; do files+=("$1"); shift; done
  (($#)) && shift && extra=("$@")
  local stamp="$venv/.ebbtide-requirements-$(echo "${files[*]}" | tr ' /' '__')"
  local want
  want=$(cd "$repo" && cat "${files[@]}" && echo "${extra[*]}")
  [ "$want" = "$(cat "$stamp" 2>/dev/null)" ] && return 0
  say "installing ${files[*]}"
  local torch_pin args=()
  torch_pin="torch==$(torch_version)"
  for f in "${files[@]}"; do args+=(-r "$repo/$f"); done
  # pip's notes on empty local index folders (this machine's pip
  # configuration) are left out; a failing install still stops the script.
  local log="$venv/.ebbtide-pip.log"
  if ! "$py" -m pip install -q "${args[@]}" -c <(echo "$torch_pin") >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    exit 1
  fi
  grep -v "^WARNING: Location" "$log" || true
  local pkg
  for pkg in "${extra[@]}"; do "$py" -m pip install -q --no-deps "$pkg"; done
  echo "$want" >"$stamp"
}

# What a build of ebbtide depends on: its sources, build files, torch and Python.
build_inputs_hash() {
  (cd "$repo" && find CMakeLists.txt pyproject.toml cmake cpp/CMakeLists.txt cpp/include cpp/src \
      python/CMakeLists.txt python/src python/ebbtide -type f ! -name '*.pyc' ! -path '*/__pycache__/*' \
      | LC_ALL=C sort | xargs sha256sum
   echo "$("$py" -c 'import sys; print(sys.version)') $(torch_version)") | sha256sum | cut -d' ' -f1
}

# The installed torch's version, from its metadata: importing torch takes
# about 2 s of a rerun of scripts/demo.sh, and before numpy is installed it
# warns that numpy is missing.
torch_version() {
  "$py" -c 'import importlib.metadata as m; print(m.version("torch"))'
}

# Builds and installs ebbtide (the native modules by scikit-build-core and
# CMake) unless the installed one was built from exactly these inputs.
ensure_ebbtide() {
  local stamp="$venv/.ebbtide-build" want
  want=$(build_inputs_hash)
  if [ "$want" = "$(cat "$stamp" 2>/dev/null)" ] && "$py" -c "import ebbtide._core" 2>/dev/null; then
    say "ebbtide is built from these sources already"
    return 0
  fi
  say "building and installing ebbtide"
  rm -f "$stamp"
  "$py" -m pip install -q --no-build-isolation "$repo" 2>&1 | grep -v "^WARNING: Location" || true
  "$py" -c "import ebbtide._core" || { echo "ebbtide failed to install" >&2; exit 1; }
  echo "$want" >"$stamp"
}
