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
