#!/usr/bin/env bash
# The I/O-engine table of docs/performance.md ("Disk offload: the I/O engine"):
# fio against one O_DIRECT file in DIR, for the engine lattice's disk store
# uses (psync: a thread doing pread/pwrite) and the alternatives it was
# measured against, each row read-only, write-only and mixed.
#
#   bench/io_engines.sh [DIR] [--size SIZE] [--runtime SECONDS] [--quick]
#
# DIR      where the test file goes: the file system to measure (default
#          $TMPDIR, else /tmp). It must support O_DIRECT; a tmpfs (which
#          kernels since 6.6 accept) measures memory, not a disk.
# --size   the file's size, as fio takes it (default 1G, the table's; at
#          least 100M).
# --runtime seconds per job (default 5); --quick: 1 (the table's rows, noisier).
#
# Rows (the table's, in its order):
#   psync     bs 10 MiB, queue depth 1   (lattice's: one window per request)
#   psync     bs 1 MiB,  queue depth 1
#   io_uring  bs 1 MiB,  queue depth 16
#   io_uring  bs 10 MiB, queue depth 4
#   libaio    bs 1 MiB,  queue depth 16
# each as three fio jobs: --rw=read, --rw=write and --rw=rw (50% reads, what
# "mixed" means in the table), all --direct=1 --time_based. GB/s = 10^9
# bytes a second, from fio's --output-format=json (bw_bytes).
#
# fio is installed with `apt-get install fio` (the Debian archive; bookworm
# has fio 3.33, the version of the doc's figures) when it is missing, which
# needs root. Prints the CPU, kernel, fio version and the file system and
# disk under DIR (df, lsblk) above the table. The test file is removed on
# exit, also after a failure or Ctrl-C. A job that fails (an engine the
# kernel or a container's seccomp refuses, a file system without O_DIRECT)
# prints fio's reason in its row; the other rows still run.
set -euo pipefail

source "$(dirname "$0")/common.sh"  # no cd: DIR is relative to the caller's directory
DIR="" SIZE=1G RUNTIME=5
while [[ $# -gt 0 ]]; do
  case "$1" in
    --size) need "$@"; SIZE="$2"; shift 2 ;;
    --runtime) need "$@"; posint --runtime "$2"; RUNTIME="$2"; shift 2 ;;
    --quick) RUNTIME=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *)
      [[ -z "$DIR" ]] || { echo "$BENCH_NAME: one directory only (got '$DIR' and '$1')" >&2; exit 2; }
      DIR="$1"; shift ;;
  esac
done
DIR=${DIR:-${TMPDIR:-/tmp}}
[[ "$SIZE" =~ ^[1-9][0-9]*[KkMmGg]?$ ]] ||
  { echo "$BENCH_NAME: --size needs a size such as 1G, 512M or 1073741824, got '$SIZE'" >&2; exit 2; }
# Mixed jobs alternate reads and writes over the file: it must hold several 10 MiB blocks.
(( $(numfmt --from=iec "${SIZE^^}") >= 100 * 1048576 )) ||
  { echo "$BENCH_NAME: --size $SIZE is too small for 10 MiB blocks: give 100M or more" >&2; exit 2; }
[[ -d "$DIR" && -w "$DIR" ]] || { echo "$BENCH_NAME: '$DIR' is not a writable directory" >&2; exit 2; }

if ! command -v fio > /dev/null; then
  echo "$BENCH_NAME: fio is missing: installing it from the Debian archive (apt-get install fio)" >&2
  if [[ $(id -u) -eq 0 ]]; then
    apt-get install -y -q fio > /dev/null
  elif command -v sudo > /dev/null; then
    sudo apt-get install -y -q fio > /dev/null
  else
    echo "$BENCH_NAME: cannot install fio without root: run 'apt-get install fio' as root" >&2
    exit 2
  fi
fi

WORK=$(mktemp -d)
FILE="$DIR/lattice_io_engines.$$.dat"
trap 'rm -rf "$WORK"; rm -f "$FILE"' EXIT
trap 'exit 130' INT TERM

# ---- The machine and the disk under DIR -----------------------------------------
echo "# bench/io_engines.sh $DIR --size $SIZE --runtime $RUNTIME ($(date -u '+%Y-%m-%d %H:%M UTC'))"
# Family and model too: a VM may name its CPU "AMD EPYC" only (family 26 is Zen 5).
CPU_NAME=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
CPU_ID="family $(lscpu | sed -n 's/^CPU family: *//p' | head -n 1) model $(lscpu | sed -n 's/^Model: *//p' | head -n 1)"
echo "# CPU: $CPU_NAME ($CPU_ID), $(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# kernel $(uname -r); $(fio --version)"
SOURCE=$(df --output=source "$DIR" | tail -n 1)
echo "# file system: $(df -h --output=source,fstype,size,avail,target "$DIR" | tail -n 1 | tr -s ' ') (source type size free mount)"
[[ $(df --output=fstype "$DIR" | tail -n 1) != tmpfs ]] || echo "# note: $DIR is a tmpfs: these figures are memory's, not a disk's"
if [[ -b "$SOURCE" ]]; then
  # The disk under a partition (or the device itself when it has no parent).
  DISK=$(lsblk -no pkname "$SOURCE" 2> /dev/null | head -n 1)
  DISK=${DISK:-$(basename "$SOURCE")}
  # ROTA="1" is what a virtio disk reports whatever is behind it.
  echo "# disk: $(lsblk -dnP -o NAME,SIZE,ROTA,TRAN,MODEL "/dev/$DISK" 2> /dev/null)"
  [[ -r "/sys/block/$DISK/queue/scheduler" ]] && echo "# scheduler: $(cat "/sys/block/$DISK/queue/scheduler")"
else
  echo "# disk: '$SOURCE' is no block device here (a container's overlay?): lsblk -d says"
  lsblk -dnP -o NAME,SIZE,ROTA,TRAN,MODEL 2> /dev/null | sed 's/^/#   /'
fi

# ---- The jobs ---------------------------------------------------------------------
ROWS=("psync 10M 1" "psync 1M 1" "io_uring 1M 16" "io_uring 10M 4" "libaio 1M 16")
# Lay the file out once (fio would do it before the first job anyway).
if ! fio --name=layout --filename="$FILE" --size="$SIZE" --create_only=1 > "$WORK/layout.log" 2>&1; then
  echo "$BENCH_NAME: fio could not create $FILE: $(grep -v '^[[:space:]]*$' "$WORK/layout.log" | tail -n 1)" >&2
  exit 1
fi
for row in "${ROWS[@]}"; do
  read -r engine bs depth <<< "$row"
  for rw in read write rw; do
    tag="$engine-$bs-$depth-$rw"
    echo "  $engine bs=$bs iodepth=$depth rw=$rw (${RUNTIME} s)" >&2
    fio --name="$tag" --filename="$FILE" --size="$SIZE" --direct=1 --ioengine="$engine" --bs="$bs" \
      --iodepth="$depth" --rw="$rw" --rwmixread=50 --runtime="$RUNTIME" --time_based \
      --output-format=json --output="$WORK/$tag.json" > "$WORK/$tag.log" 2>&1 || true
  done
done

# ---- The table ----------------------------------------------------------------------
python3 - "$WORK" "${ROWS[@]}" <<'PY'
import json, os, sys

work, rows = sys.argv[1], sys.argv[2:]
blocks = {"10M": "10 MiB", "1M": "1 MiB"}

def job(tag):
    """fio's job result for tag, or the reason it has none."""
    try:
        with open(os.path.join(work, tag + ".json")) as f:
            text = f.read()
        d = json.loads(text[text.index("{"):])  # fio may print notes before the JSON
        j = d["jobs"][0]
        if j.get("error"):
            raise ValueError(f"fio error {j['error']}")
        return j, None
    except (OSError, ValueError, KeyError, IndexError) as e:
        log = os.path.join(work, tag + ".log")
        lines = [l.strip() for l in open(log) if l.strip()] if os.path.exists(log) else []
        return None, (lines[-1] if lines else str(e))

def gbs(j, direction):
    return f"{j[direction]['bw_bytes'] / 1e9:.2f}"

print()
print("| engine | block | queue depth | read | write | mixed read / write |")
print("|---|---|---:|---:|---:|---:|")
failures = []
for row in rows:
    engine, bs, depth = row.split()
    cells = []
    for rw in ("read", "write", "rw"):
        j, why = job(f"{engine}-{bs}-{depth}-{rw}")
        if j is None:
            cells.append("failed")
            failures.append(f"{engine} bs={bs} iodepth={depth} rw={rw}: {why}")
        elif rw == "rw":
            cells.append(f"{gbs(j, 'read')} / {gbs(j, 'write')}")
        else:
            cells.append(gbs(j, rw))
    print(f"| {engine} | {blocks.get(bs, bs)} | {depth} | " + " | ".join(cells) + " |")
print("\nGB/s (10^9 bytes a second), fio --direct=1; mixed: --rw=rw, 50% reads.")
for f in failures:
    print("failed:", f)
sys.exit(1 if failures else 0)
PY
