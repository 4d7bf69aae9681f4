#!/usr/bin/env bash
# Mixture of experts (docs/moe.md): speed and memory of an 8-expert top-2
# model beside the dense model with the same active parameters, one process
# and expert-parallel over 2 ranks; and (--loss) their training losses over
# the same tokens of the bundled text.
#
#   bench/moe.sh [--quick] [--steps S] [--warmup W] [--rows a,b] [--loss] [--loss-steps N] [--out results.jsonl]
#
# Speed: GPT-2 124M (L=12 C=768 H=12 V=50257, ffn 3072), B=4 T=256 per rank,
# synthetic tokens, `lattice bench train --json`. The MoE model replaces
# every MLP by 8 experts of width 1536 (top-2: 2 x 1536 = the dense 3072, so
# the same model FLOPs per token up to the router's 8 x 768). Rows:
#   dense-1p   one process, 2 threads            moe-1p    the same, MoE
#   dense-dp2  2 ranks x 1 thread, dp=2          moe-ep2   2 ranks, dp=2, ep=2 (4 experts a rank)
# Columns: tokens/s, the MoE's ratio to the dense row of the same ranks in
# model FLOP/s (active FLOPs), the step's time in routing and permutations,
# the expert MLPs and the all-to-alls, and rank 0's peak memory.
#
# --loss: the demo (configs/demo.toml: L=4 C=128 T=128, 600 steps on
# Moby-Dick) dense and as 8 experts of width 256 top-2 (= its ffn 512), same
# data order and seed; their validation losses every 100 steps.
# --quick: L=2 C=128 H=4 V=1000 T=64 (a smoke test of the script; --loss 60 steps).
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
common_defaults
LOSS=0 LOSS_STEPS=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --loss) LOSS=1; shift ;;
    --loss-steps) need "$@"; LOSS_STEPS="$2"; shift 2 ;;
    *) common_option "$@" || { echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2; }
       shift "$COMMON_SHIFT" ;;
  esac
done
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 4); fi
if [[ -z "$WARMUP" ]]; then WARMUP=1; fi
if [[ -z "$LOSS_STEPS" ]]; then LOSS_STEPS=$([[ $QUICK == 1 ]] && echo 60 || echo 600); fi
posint --steps "$STEPS"
posint --loss-steps "$LOSS_STEPS"
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

MODEL=(--set model.n_layer=12 --set model.n_embd=768 --set model.n_head=12 --set model.vocab_size=50257
       --set model.seq_len=256 --set train.micro_batch_size=4)
MOE=(--set model.n_experts=8 --set model.top_k=2 --set model.moe_ffn_hidden=1536)
if [[ $QUICK == 1 ]]; then
  MODEL=(--set model.n_layer=2 --set model.n_embd=128 --set model.n_head=4 --set model.vocab_size=1000
         --set model.seq_len=64 --set train.micro_batch_size=4)
  MOE=(--set model.n_experts=8 --set model.top_k=2 --set model.moe_ffn_hidden=256)
fi
RESULTS=${OUT:-$(mktemp)}
: > "$RESULTS"
echo "$BENCH_NAME: $(date -u '+%Y-%m-%d %H:%M UTC'), $STEPS steps after $WARMUP" >&2
BENCH=(bench train --steps "$STEPS" --warmup "$WARMUP" --json)
MPI=(mpiexec -n 2 --oversubscribe --bind-to "$BIND_TO")
# row NAME CMD...: times the row unless --rows leaves it out.
row() {
  local name=$1
  shift
  keep_row "$name" || return 0
  echo "  $name" >&2
  time_row "$name" 1 "$RESULTS" "$@"
}
row dense-1p "$LATTICE_BIN" "${BENCH[@]}" "${MODEL[@]}" --set train.threads=2
row moe-1p "$LATTICE_BIN" "${BENCH[@]}" "${MODEL[@]}" "${MOE[@]}" --set train.threads=2
row dense-dp2 "${MPI[@]}" "$LATTICE_BIN" "${BENCH[@]}" "${MODEL[@]}" --set train.threads=1 --set parallel.dp=2
row moe-ep2 "${MPI[@]}" "$LATTICE_BIN" "${BENCH[@]}" "${MODEL[@]}" "${MOE[@]}" --set train.threads=1 \
  --set parallel.dp=2 --set parallel.ep=2

"$PYTHON" - "$RESULTS" <<'EOF'
import json, sys
rows = {}
if not open(sys.argv[1]).read().strip():
    sys.exit(0)  # --rows kept none
for line in open(sys.argv[1]):
    name, _, js = line.rstrip("\n").split("\t", 2)
    rows[name] = json.loads(js)
ok = [r for r in rows.values() if not r.get("failed")]
if not ok:
    sys.exit("bench/moe.sh: every row failed")
r0 = ok[0]
print(f"CPU: {r0['cpu']} ({r0['isa']}); model L={r0['n_layer']} C={r0['n_embd']} H={r0['n_head']} "
      f"V={r0['vocab_size']}, B={r0['batch']} T={r0['seq']} per rank\n")
print("| row | ranks x threads | params | active | tok/s | model GFLOP/s | x dense | routing ms | experts ms | all-to-all ms | all-to-all MiB/step | peak MiB (rank 0) |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name in ["dense-1p", "moe-1p", "dense-dp2", "moe-ep2"]:
    r = rows.get(name)
    if not r or r.get("failed"):
        print(f"| {name} | failed |")
        continue
    dense = rows.get("dense-1p" if name.endswith("1p") else "dense-dp2")
    ratio = r["model_flops_per_sec"] / dense["model_flops_per_sec"] if dense and not dense.get("failed") else float("nan")
    moe = r.get("n_experts", 0) > 0
    print(f"| {name} | {r['ranks']} x {r['threads']} | {r['n_params'] / 1e6:.1f}M | {r['active_params'] / 1e6:.1f}M | "
          f"{r['tokens_per_sec']:.0f} | {r['model_flops_per_sec'] / 1e9:.1f} | {ratio:.2f} | "
          + (f"{r['moe_route_ms']:.0f} | {r['moe_expert_ms']:.0f} | {r['ep_comm_ms']:.0f} | "
             f"{r['ep_comm_bytes_per_step'] / 2**20:.1f} | " if moe else "- | - | - | - | ")
          + f"{r['peak_mem_bytes'] / 2**20:.0f} |")
EOF

[[ $LOSS == 1 ]] || exit 0
echo >&2
echo "$BENCH_NAME: --loss, $LOSS_STEPS steps each (configs/demo.toml)" >&2
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
# (no checkpoints: checkpoint.every and keep back at their defaults, which apply only with a directory)
LOSS_ARGS=(-c configs/demo.toml --set train.steps="$LOSS_STEPS" --set checkpoint.dir= --set checkpoint.every=0
           --set checkpoint.keep=3 --set log.every=100)
if [[ $QUICK == 1 ]]; then LOSS_ARGS+=(--set train.eval_every=20 --set model.n_layer=2); fi
"$LATTICE_BIN" train "${LOSS_ARGS[@]}" --set log.metrics_file="$DIR/dense.jsonl" > "$DIR/dense.log"
"$LATTICE_BIN" train "${LOSS_ARGS[@]}" --set log.metrics_file="$DIR/moe.jsonl" --set model.n_experts=8 \
  --set model.top_k=2 --set model.moe_ffn_hidden=256 > "$DIR/moe.log"
"$PYTHON" - "$DIR/dense.jsonl" "$DIR/moe.jsonl" <<'EOF'
import json, sys
def read(p):
    return [json.loads(l) for l in open(p) if l.strip()]
d, m = read(sys.argv[1]), read(sys.argv[2])
print("\n| step | dense train | MoE train | dense val | MoE val | MoE aux |")
print("|---:|---:|---:|---:|---:|---:|")
mv = {r["step"]: r for r in m}
for r in d:
    if "val_loss" not in r:
        continue
    x = mv.get(r["step"], {})
    print(f"| {r['step']} | {r['loss']:.4f} | {x.get('loss', float('nan')):.4f} | {r['val_loss']:.4f} | "
          f"{x.get('val_loss', float('nan')):.4f} | {x.get('aux_loss', float('nan')):.4f} |")
dt = sum(r["step_ms"] for r in d[1:]) / max(1, len(d) - 1)
mt = sum(r["step_ms"] for r in m[1:]) / max(1, len(m) - 1)
print(f"\nmean step: dense {dt:.1f} ms, MoE {mt:.1f} ms ({mt / dt:.2f}x)")
EOF
