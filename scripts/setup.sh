#!/usr/bin/env bash
# Set up .venv for Nestling on a fresh machine. `--dev` adds the test tools and the mosquitto broker
# the integration tests start themselves. Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
# Torch first, pinned to the CPU wheel, so nothing below can pull a multi-GB CUDA build on a CPU board.
# Everything installs under the `nestling` namespace (an editable install maps nestling.server to ./server
# and so on). On a Jetson, install JetPack's torch into the venv beforehand; it is kept (any torch 2.1-2.14 is accepted).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install --quiet "torch==2.13.0"
fi
if [ "${1:-}" = "--dev" ]; then
  # The Ray backend is tested too (ray's wheel needs no torch or CUDA of its own).
  $PIP install --quiet -e ".[dev,ray]"
  # Debian packages the tests use: the mosquitto broker they start themselves, and Fashion-MNIST for the IDX loader.
  missing=()
  command -v mosquitto >/dev/null 2>&1 || missing+=(mosquitto)
  [ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
  if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq "${missing[@]}")) \
      || echo "note: could not install ${missing[*]}; the tests that need them will be skipped" >&2
  fi
else
  $PIP install --quiet -e .
fi
