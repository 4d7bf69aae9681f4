# Helpers the bench/compare_*.sh drivers share; source it after `cd` to the repo root.
# BENCH_NAME (the script's name) prefixes every message.
BENCH_NAME=$(basename "$0")

# The script's header comment, without the shebang: its --help.
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
# need OPTION "$@": the option has a value after it.
need() { [[ $# -ge 2 ]] || { echo "$BENCH_NAME: $1 needs a value (see --help)" >&2; exit 2; }; }
posint() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "$BENCH_NAME: $1 needs a positive integer, got '$2'" >&2; exit 2; }; }
# keep_row NAME: whether --rows (ROWS_FILTER, comma-separated substrings) keeps the row.
keep_row() {
  [[ -z "${ROWS_FILTER:-}" ]] && return 0
  local f
  IFS=',' read -ra filters <<< "$ROWS_FILTER"
  for f in "${filters[@]}"; do [[ -n "$f" && "$1" == *"$f"* ]] && return 0; done
  return 1
}
# The last line of stdin that is a JSON object with an "impl" key, or nothing.
json_line() { grep -E '^\{.*"impl"' | tail -n 1 || true; }

# The options and defaults the timing drivers share. common_defaults sets them;
# common_option "$@" takes one of them off the command line, setting
# COMMON_SHIFT to the arguments it used, or returns 1 when $1 is not one.
common_defaults() {
  PYTHON=${PYTHON:-/usr/bin/python3}
  LATTICE_BIN=${LATTICE_BIN:-build/lattice}
  ROWS_FILTER="" STEPS="" WARMUP="" QUICK=0 REPEAT=1 OUT="" BIND_TO=core TIMEOUT=1800
}
common_option() {
  COMMON_SHIFT=2
  case "$1" in
    --quick) QUICK=1; COMMON_SHIFT=1 ;;
    --rows) need "$@"; ROWS_FILTER="$2" ;;
    --steps) need "$@"; STEPS="$2" ;;
    --warmup) need "$@"; WARMUP="$2" ;;
    --repeat) need "$@"; REPEAT="$2" ;;
    --out) need "$@"; OUT="$2" ;;
    --bind-to) need "$@"; BIND_TO="$2" ;;
    --timeout) need "$@"; TIMEOUT="$2" ;;
    -h|--help) usage; exit 0 ;;
    *) return 1 ;;
  esac
}

# time_row NAME RUN RESULTS CMD...: runs one row's command under $TIMEOUT and
# appends "NAME<TAB>RUN<TAB>its JSON line" (a failed marker when it printed
# none) to RESULTS, passing on the reason of a failure.
time_row() {
  local name=$1 run=$2 results=$3 rc=0 out err js
  shift 3
  out=$(mktemp) err=$(mktemp)
  timeout --kill-after=10 "$TIMEOUT" "$@" > "$out" 2> "$err" || rc=$?
  js=$(json_line < "$out")
  if [[ -z "$js" ]]; then
    echo "   failed (exit $rc): $(grep -v '^[[:space:]]*$' "$err" | tail -n 1)" >&2
    js='{"impl":"lattice","failed":true}'
  fi
  printf '%s\t%s\t%s\n' "$name" "$run" "$js" >> "$results"
  rm -f "$out" "$err"
}
# write_jsonl RESULTS OUT: every row's JSON, with its "row" and "run", appended to OUT.
write_jsonl() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "a") as out:
    for line in f:
        row, run, js = line.rstrip("\n").split("\t", 2)
        d = json.loads(js)
        d.update({"row": row, "run": int(run)})
        out.write(json.dumps(d) + "\n")
PY
}
