#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine lacks (it has Python 3.12, torch+CUDA and transformers 5.17, no
# network) into a git-ignored folder (default .whl/), at the versions of the lock (constraints.txt). Then a device
# run names that folder in its carry list and calls scripts/gpu_check.sh, which installs them first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$ROOT/.whl}"; mkdir -p "$out"
PY="${EMBODIRL_PYTHON:-python3}"
plat=()
for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
version() { grep -i "^$1==" "$ROOT/constraints.txt" | head -1; }
for p in transformers huggingface_hub httpx2 httpcore2 truststore click typer shellingham tokenizers regex hf-xet peft \
         hydra-core omegaconf tensordict pyvers simplejpeg gymnasium Farama-Notifications; do
  pin="$(version "$p")"
  [[ -n "$pin" ]] || { echo "gpu_wheels: $p is not in constraints.txt" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$out" "$pin"
done
# the video codec: the lock's imageio-ffmpeg 0.8 wheel is 68 MB, over a run's 64 MiB; 0.6.0 (29 MB) carries the same
# ffmpeg binary interface that imageio's writer calls (get_ffmpeg_exe, write_frames)
rm -f "$out"/imageio_ffmpeg-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$out" imageio-ffmpeg==0.6.0
"$PY" -m pip wheel -q --no-deps -w "$out" "$(version antlr4-python3-runtime)"   # an sdist only on the index
du -sh "$out"
