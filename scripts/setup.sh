#!/usr/bin/env bash
# Set up .venv for Nestling. Safe to run again: it skips what is already there.
#   bash scripts/setup.sh           a workstation: server, simulator, demo, reports (the [workstation] extra)
#   bash scripts/setup.sh --dev     the same plus the test tools and the Debian packages the tests use
#   bash scripts/setup.sh --board   a board (Raspberry Pi OS 64-bit, Jetson on JetPack 6, any 64-bit Linux):
#                                   only what `nestling agent` and `nestling infer` run (docs/deploy.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=${1:-}
case "$MODE" in "" | --dev | --board) ;; *) echo "usage: bash scripts/setup.sh [--dev | --board]" >&2; exit 2 ;; esac
# The CPU wheels pinned per architecture. PyPI's aarch64 torch is a CPU build up to 2.10 and a CUDA build
# (gigabytes of NVIDIA dependencies, no import without them) from 2.11 on; 2.9.1 is the newest small one.
TORCH_X86_64=2.13.0
TORCH_AARCH64=2.9.1
TEGRA_RELEASE=${NESTLING_TEGRA_RELEASE:-/etc/nv_tegra_release}

fail() {
  echo "error: $*" >&2
  exit 1
}

# What the interpreter is, before anything is installed: machine, pointer bits, version, and a torch it
# already sees (a system or JetPack build), as "machine bits major minor torch-version|-".
probe() {
  "$PYTHON" - <<'EOF'
import platform, struct, sys
try:
    import torch
    version = torch.__version__.split("+")[0]
except Exception:
    version = "-"
print(platform.machine(), struct.calcsize("P") * 8, sys.version_info[0], sys.version_info[1], version)
EOF
}

# Refuse what cannot work, with the reason, before a venv or a download: a 32-bit OS, a Python older
# than 3.10 (JetPack 5), a JetPack older than 6, a system torch outside the accepted range.
check_board() {
  command -v "$PYTHON" >/dev/null 2>&1 || fail "no $PYTHON on this board: install Python >= 3.10 (sudo apt-get install python3 python3-venv)"
  local machine bits major minor system_torch jetpack=""
  read -r machine bits major minor system_torch < <(probe) || fail "$PYTHON did not run"
  if [ -f "$TEGRA_RELEASE" ]; then
    local l4t
    l4t=$(sed -n 's/^# R\([0-9]*\) .*/\1/p' "$TEGRA_RELEASE" | head -n1)
    case "$l4t" in
      36) jetpack=6 ;;
      35) jetpack=5 ;;
      32) jetpack=4 ;;
      *) jetpack="unknown (L4T R${l4t:-?})" ;;
    esac
    if [ "$jetpack" != 6 ]; then
      fail "this Jetson runs JetPack $jetpack; Nestling supports JetPack 6 (L4T R36: Ubuntu 22.04, Python 3.10). JetPack 5 ships Python 3.8 and JetPack 4 Python 3.6, older than the 3.10 Nestling needs: flash JetPack 6 (Orin boards), or run the agent on another board"
    fi
  fi
  if [ "$bits" != 64 ] || [[ "$machine" =~ ^(armv[0-9]+l|armhf|armel|i[3-6]86)$ ]]; then
    fail "this is a 32-bit system ($machine, ${bits}-bit Python): PyTorch publishes no wheels for it. Install a 64-bit OS (Raspberry Pi OS 64-bit: \`uname -m\` and \`python3 -c 'import platform; print(platform.machine())'\` both print aarch64)"
  fi
  if [ "$major" -lt 3 ] || { [ "$major" = 3 ] && [ "$minor" -lt 10 ]; }; then
    fail "Nestling needs Python >= 3.10; $PYTHON is $major.$minor (Raspberry Pi OS Bookworm has 3.11, Ubuntu 22.04 / JetPack 6 has 3.10)"
  fi
  if [ "$system_torch" != "-" ]; then
    "$PYTHON" -c "import sys; v = tuple(int(p) for p in '$system_torch'.split('.')[:2]); sys.exit(not ((2, 1) <= v <= (2, 14)))" \
      || fail "the system's torch $system_torch is outside the range Nestling accepts (2.1 to 2.14); pip would install another one next to it. Install a torch in that range first (on a Jetson: NVIDIA's build for JetPack 6)"
    echo "keeping the system's torch $system_torch: the venv sees it (--system-site-packages) and pip will not replace it"
    VENV_FLAGS=(--system-site-packages)
  elif [ -n "$jetpack" ]; then
    fail "this Jetson (JetPack 6) has no PyTorch for $PYTHON: install NVIDIA's PyTorch for JetPack 6 first (docs/deploy.md, NVIDIA Jetson), so the agent trains on the GPU; setup.sh keeps it"
  fi
  case "$machine" in
    aarch64 | arm64) TORCH_PIN=$TORCH_AARCH64 ;;
    x86_64 | amd64) TORCH_PIN=$TORCH_X86_64 ;;
    *) fail "no CPU PyTorch wheel is pinned for $machine; install a torch between 2.1 and 2.14 for $PYTHON first, then run this again" ;;
  esac
  "$PYTHON" -c "import ensurepip" 2>/dev/null || [ -x .venv/bin/python ] \
    || fail "$PYTHON cannot create a venv: sudo apt-get install python3-venv"
}

VENV_FLAGS=()
TORCH_PIN=$TORCH_X86_64
[ "$MODE" = --board ] && check_board
[ -x .venv/bin/python ] || "$PYTHON" -m venv "${VENV_FLAGS[@]}" .venv
PIP=".venv/bin/python -m pip"
# Torch first, pinned to the CPU wheel, so nothing below can pull a multi-GB CUDA build on a CPU board.
# A torch the venv already sees (its own, or the system's through --system-site-packages) is kept.
# Everything installs under the `nestling` namespace (an editable install maps nestling.server to ./server
# and so on).
# A board compiles the bytecode of what it imports, on first import, rather than all 6,600 modules of torch,
# sympy, networkx and onnx up front (146 MB on aarch64, most of which an agent never imports).
COMPILE=()
[ "$MODE" = --board ] && COMPILE=(--no-compile)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install --quiet "${COMPILE[@]}" "torch==$TORCH_PIN"
fi
# torch's C++ headers (~60 MB, 9,400 files) serve compiling extensions and torch.compile's C++ backend, which
# need a compiler toolchain a board does not carry; the board's own torch (never a system one) goes without.
if [ "$MODE" = --board ] && [ -z "${NESTLING_KEEP_TORCH_HEADERS:-}" ]; then
  for headers in .venv/lib/python3*/site-packages/torch/include; do
    if [ -d "$headers" ]; then
      rm -rf "$headers"
      echo "removed torch's C++ headers from the venv (NESTLING_KEEP_TORCH_HEADERS=1 keeps them)"
    fi
  done
fi
case "$MODE" in
  --board)
    # The base only: torch, numpy, safetensors, onnx, onnxruntime, psutil, paho-mqtt.
    $PIP install --quiet --no-compile -e .
    # What the dependencies ship for their own test runs and builds, which no agent, export or infer imports or
    # runs (44 MB on aarch64): onnx's backend test data (models and tensors, not modules; onnx.backend.test's
    # code stays), the `tests` packages inside sympy, numpy and networkx (their `testing` helpers stay), and
    # torch's two copies of the protobuf compiler `protoc`. Only from the venv's own packages, never a system
    # torch; NESTLING_KEEP_PACKAGE_TESTS=1 keeps them.
    if [ -z "${NESTLING_KEEP_PACKAGE_TESTS:-}" ]; then
      for site in .venv/lib/python3*/site-packages; do
        rm -rf "$site/onnx/backend/test/data" "$site/torch/bin/protoc" "$site/torch/bin/protoc-"*
        for package in sympy numpy networkx; do
          [ -d "$site/$package" ] && find "$site/$package" -depth -type d -name tests -exec rm -rf {} +
        done
      done
      echo "removed the dependencies' test suites and test data from the venv (NESTLING_KEEP_PACKAGE_TESTS=1 keeps them)"
    fi
    .venv/bin/python -c "import torch, onnxruntime; print(f'board install ready: torch {torch.__version__}, onnxruntime {onnxruntime.__version__}')"
    ;;
  --dev)
    # The Ray backend is tested too (ray's wheel needs no torch or CUDA of its own).
    $PIP install --quiet -e ".[workstation,dev,ray]"
    # Debian packages the tests use: the mosquitto broker they start themselves, and Fashion-MNIST for the IDX loader.
    missing=()
    command -v mosquitto >/dev/null 2>&1 || missing+=(mosquitto)
    [ -d /usr/share/datasets/fashion-mnist ] || missing+=(dataset-fashion-mnist)
    if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq "${missing[@]}")) \
        || echo "note: could not install ${missing[*]}; the tests that need them will be skipped" >&2
    fi
    ;;
  *)
    $PIP install --quiet -e ".[workstation]"
    ;;
esac
