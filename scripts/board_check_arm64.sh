#!/usr/bin/env bash
# The agent on a board's own userland: an arm64 Debian bookworm root filesystem (the base of Raspberry Pi OS
# 64-bit) run through qemu-user-static on this machine. It installs the agent there with the documented board
# command (`bash scripts/setup.sh --board`), joins a server on this host for two rounds of a tiny model, lets
# the board build its own ONNX deployable when the run ends, runs `nestling infer` on that bundle on the
# board, and runs the board's self-profile. Last line:
#   arch=aarch64 rounds_ok=2 export_ok=yes infer_ok=yes board_install_mb=… agent_peak_rss_mb=…
#
#   sudo bash scripts/board_check_arm64.sh [--fresh]     (after `bash scripts/setup.sh` on this host)
#
# Needs root: debootstrap, chroot, the binfmt_misc registration of qemu-aarch64 and the rootfs's mounts.
# It apt-get installs debootstrap, qemu-user-static and binfmt-support itself. The rootfs is built once and
# cached under $NESTLING_BOARD_CACHE (default /var/cache/nestling-board); --fresh reinstalls the board's venv
# (the pip cache inside the rootfs is kept). Everything runs under emulation: ~15-30 min on 2 cores.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${NESTLING_BOARD_CACHE:-/var/cache/nestling-board}
ROOTFS=$CACHE/rootfs-bookworm-arm64
MIRROR=${NESTLING_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PORT=${NESTLING_BOARD_PORT:-18839}
BOARD_RAM_MB=${NESTLING_BOARD_RAM_MB:-2048}
FRESH=no
for arg in "$@"; do
  case "$arg" in
    --fresh) FRESH=yes ;;
    *) echo "usage: sudo bash scripts/board_check_arm64.sh [--fresh]" >&2; exit 2 ;;
  esac
done

say() { echo "[board-check $(date -u +%H:%M:%S)] $*" >&2; }
fail() {
  echo "error: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "this check needs root (debootstrap, chroot, binfmt_misc, mounts): sudo bash scripts/board_check_arm64.sh"
HOST_NESTLING=$REPO/.venv/bin/nestling
[ -x "$HOST_NESTLING" ] || fail "no $HOST_NESTLING: run \`bash scripts/setup.sh\` first (the host runs the broker and the server)"

# 1. The emulator and the rootfs builder, and qemu registered for arm64 binaries (F: works inside a chroot).
missing=()
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
command -v update-binfmts >/dev/null 2>&1 || missing+=(binfmt-support)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi
[ -f /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -f /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || fail "qemu-aarch64 is not enabled in binfmt_misc"

# 2. The rootfs: Debian bookworm arm64, minimal, with Python 3.11 and venv (what Raspberry Pi OS 64-bit has).
if [ ! -f "$ROOTFS/.nestling-rootfs-ok" ]; then
  say "building $ROOTFS with debootstrap (mostly download; the second stage runs under emulation)"
  mkdir -p "$CACHE"
  rm -rf "$ROOTFS.partial"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOTFS.partial" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || fail "debootstrap failed: see $CACHE/debootstrap.log"
  rm -rf "$ROOTFS"
  mv "$ROOTFS.partial" "$ROOTFS"
  touch "$ROOTFS/.nestling-rootfs-ok"
fi
[ "$(chroot "$ROOTFS" uname -m)" = aarch64 ] || fail "the rootfs does not run as aarch64"

WORK=$(mktemp -d /tmp/nestling-board-check.XXXXXX)
BOARD=$ROOTFS/opt/board
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${CGROUP:-}" ] && rmdir "$CGROUP" 2>/dev/null
  for mount in proc/cpuinfo dev/pts dev sys proc; do
    mountpoint -q "$ROOTFS/$mount" && umount -R -l "$ROOTFS/$mount"
  done
  return 0
}
trap cleanup EXIT
# Recursive for /sys: the agent reads its memory cgroup under /sys/fs/cgroup, a mount of its own.
for mount in proc sys dev dev/pts; do
  mkdir -p "$ROOTFS/$mount"
  if ! mountpoint -q "$ROOTFS/$mount"; then
    if [ "$mount" = sys ]; then
      mount --rbind /sys "$ROOTFS/sys" && mount --make-rslave "$ROOTFS/sys"
    else
      mount --bind "/$mount" "$ROOTFS/$mount"
    fi
  fi
done
# The board's CPU: a Raspberry Pi 4's Cortex-A72, for qemu (QEMU_CPU below) and in /proc/cpuinfo. qemu-user
# passes the host's /proc/cpuinfo through (an x86 CPU's), and onnxruntime's CPU detection dies on it when its
# library loads (SIGSEGV: "qemu: uncaught target signal 11" at import, so at the board's first export); on a
# real board /proc/cpuinfo describes its ARM cores, as this file does.
CPUINFO=$CACHE/cpuinfo-cortex-a72
: >"$CPUINFO"
for i in $(seq 0 $(($(nproc) - 1))); do
  printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n' "$i" >>"$CPUINFO"
done
printf 'Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B (emulated by qemu-user)\n' >>"$CPUINFO"
mountpoint -q "$ROOTFS/proc/cpuinfo" || mount --bind "$CPUINFO" "$ROOTFS/proc/cpuinfo"
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
# This host's trust store, so the board reaches PyPI as this host does (behind a site's TLS proxy too).
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
board() { chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS=1 QEMU_CPU=cortex-a72 "$@"; }

# 3. The board install: this checkout's files (no venv, no git), then the documented command on the board.
say "copying the source to /opt/nestling on the board"
mkdir -p "$ROOTFS/opt/nestling"
[ "$FRESH" = yes ] && rm -rf "$ROOTFS/opt/nestling/.venv"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) \
  | tar -xf - -C "$ROOTFS/opt/nestling"
say "bash scripts/setup.sh --board (on the board)"
started=$(date +%s)
board /bin/bash -c "cd /opt/nestling && nice -n 10 bash scripts/setup.sh --board" 2>&1 | tee "$WORK/setup.log" >&2
install_s=$(($(date +%s) - started))
board_install_mb=$(du -sm "$ROOTFS/opt/nestling/.venv" | cut -f1)
say "board venv: ${board_install_mb} MB, setup took ${install_s} s"
board /opt/nestling/.venv/bin/python -c "import sys; blocked = ('matplotlib', 'sklearn', 'scipy', 'amqtt', 'rich', 'cryptography', 'PIL'); import importlib.util as u; extra = [m for m in blocked if u.find_spec(m)]; sys.exit(f'workstation packages on the board: {extra}' if extra else 0)"

# 4. The fleet: broker and server on this host, the agent on the board (the chroot shares the loopback).
rm -rf "$BOARD" && mkdir -p "$BOARD"
cat >"$WORK/fleet.toml" <<EOF
[broker]
url = "mqtt://127.0.0.1:$PORT"
fleet = "board-check"
[fleet]
devices = 1
min_devices = 1
round_min_devices = 1
registration_timeout_s = 3600
heartbeat_timeout_s = 600
[enrolment]
devices = ["arm64-board"]
[run]
rounds = 2
seed = 0
out_dir = "run"
deadline_s = 3600
quorum = 1.0
eval_every = 1
[data]
dataset = "synthetic"
limit_test = 100
[model]
arch = "tinycnn"
[method]
name = "fedavg"
[export]
on_finish = "requested"
timeout_s = 3600
[train]
fraction = 1.0
local_steps = 4
batch_size = 16
lr = 0.05
momentum = 0.9
EOF
cat >"$BOARD/agent.toml" <<EOF
[broker]
url = "mqtt://127.0.0.1:$PORT"
fleet = "board-check"
[device]
id = "arm64-board"
torch_device = "cpu"
threads = 1
profile = true
profile_repeats = 1
[data]
dataset = "synthetic"
client_index = 0
num_clients = 1
limit_train = 200
[agent]
heartbeat_s = 5.0
[export]
on_finish = true
format = "onnx"
out_dir = "/opt/board/bundle"
calib_samples = 32
eval_samples = 64
EOF
say "starting the embedded broker on 127.0.0.1:$PORT and the server (host)"
"$HOST_NESTLING" broker --port "$PORT" >"$WORK/broker.log" 2>&1 &
PIDS+=($!)
sleep 3
(cd "$WORK" && OMP_NUM_THREADS=1 exec "$HOST_NESTLING" server --config fleet.toml --log-level INFO) >"$WORK/server.log" 2>&1 &
SERVER=$!
PIDS+=("$SERVER")
say "starting the agent on the board (two rounds, then its own ONNX export; logs in $WORK)"
# The board's RAM: a memory cgroup of $BOARD_RAM_MB (a 2 GB Pi 4 by default) holds the agent, so the budget it
# measures for training is a board's, not this host's (qemu-user shows the guest the host's /proc/meminfo).
CGROUP=""
for base in /sys/fs/cgroup/memory /sys/fs/cgroup/unified /sys/fs/cgroup; do
  if [ -f "$base/memory.limit_in_bytes" ] || grep -qw memory "$base/cgroup.subtree_control" 2>/dev/null; then
    CGROUP=$base/nestling-board-check-$$
    mkdir -p "$CGROUP"
    if [ -f "$CGROUP/memory.limit_in_bytes" ]; then limit_file=memory.limit_in_bytes; else limit_file=memory.max; fi
    echo $((BOARD_RAM_MB * 1024 * 1024)) >"$CGROUP/$limit_file"
    break
  fi
done
[ -n "$CGROUP" ] || say "no memory cgroup to enter: the agent's training budget will be this host's available memory"
sh -c 'if [ -n "$1" ]; then echo $$ >"$1/cgroup.procs"; fi; shift; exec "$@"' sh "$CGROUP" \
  chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS=1 QEMU_CPU=cortex-a72 \
  nice -n 10 /opt/nestling/.venv/bin/nestling agent --config /opt/board/agent.toml --log-level INFO \
  >"$WORK/agent.log" 2>&1 &
AGENT=$!
PIDS+=("$AGENT")
server_rc=0
wait "$SERVER" || server_rc=$?
agent_alive=yes
kill -0 "$AGENT" 2>/dev/null || agent_alive=no
kill -TERM "$AGENT" 2>/dev/null || true
agent_rc=0
wait "$AGENT" || agent_rc=$?
say "server exited $server_rc; agent alive at the end: $agent_alive (exit $agent_rc after SIGTERM)"
cp "$WORK/agent.log" "$CACHE/last-agent.log"
cp "$WORK/server.log" "$CACHE/last-server.log"

# 5. What the run produced: rounds, the board's export report, infer on the bundle, the self-profile.
read -r rounds_ok export_ok < <("$REPO/.venv/bin/python" - "$WORK/run" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()] if (run / "metrics.jsonl").exists() else []
rounds = len({row["round"] for row in lines if "round" in row})
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
rows = summary.get("deployables", [])
ok = any(isinstance(r, dict) and r.get("device_id") == "arm64-board" and r.get("status") == "ok" for r in rows)
print(rounds, "yes" if ok else "no")
EOF
) || { rounds_ok=0; export_ok=no; }
infer_ok=no
if [ -f "$BOARD/bundle/bundle.json" ]; then
  board /opt/nestling/.venv/bin/python -c "import numpy as np; np.save('/opt/board/x.npy', np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32))"
  if board /opt/nestling/.venv/bin/nestling infer --bundle /opt/board/bundle /opt/board/x.npy --json >"$WORK/infer.json" 2>"$WORK/infer.err"; then
    infer_ok=yes
  fi
  say "nestling infer on the board: $infer_ok ($(tr -d " \n" <"$WORK/infer.json" | head -c 160))"
fi
profile_line=$(grep -m1 "profile of tinycnn" "$WORK/agent.log" | sed 's/.*nestling.agent INFO //' || true)
say "self-profile on the board: ${profile_line:-none (see $CACHE/last-agent.log)}"
# The agent's own figure at exit: its guest pages only (edge/board_memory.py), qemu's left out.
agent_peak_rss_mb=$(sed -n 's/.*peak resident memory \([0-9]*\) MiB.*/\1/p' "$WORK/agent.log" | tail -n1)
say "$(grep -m1 'peak resident memory' "$WORK/agent.log" || echo 'no memory line from the agent')"
echo "arch=$(chroot "$ROOTFS" uname -m) rounds_ok=$rounds_ok export_ok=$export_ok infer_ok=$infer_ok board_install_mb=$board_install_mb agent_peak_rss_mb=${agent_peak_rss_mb:-nan}"
