#!/usr/bin/python3
"""CTest `torch_train_reference` (label `torch`): `lattice train` against an
independent PyTorch training loop (tools/torch_train_reference.py).

Every equivalence test of lattice compares a layout with the trainer at
dp = 1; this one holds that reference itself to PyTorch, through the command
line and files only: data loader order (llm.c shards, shuffled, two shards,
an epoch boundary), seeded initialisation (f32 case) or checkpoint.init_from
(bf16 case), gradient accumulation, global-norm clipping (clips on some steps,
not on others), AdamW with its weight-decay mask and moments, warm-up + cosine
to min_lr. The final checkpoint's parameters and Adam moments, and every
step's loss, lr and grad norm, must agree within the tolerances of
DEFAULT_TOLERANCES in the tool (their measurements: tools/README.md).

    /usr/bin/python3 tests/train/torch_train_reference_test.py --lattice build/lattice [--tools DIR] [--keep DIR]

Exit 0: pass; 1: mismatch or failure; 77: skipped (torch cannot be imported).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77


def write_shard(path, tokens):
    import numpy as np
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def markov_shards(d, vocab, n, cut, seed):
    """n tokens of a learnable stream (a sparse random Markov chain: each token
    has 4 likely successors) drawn from `seed`, written as two llm.c shards
    split at token `cut`; returns their glob."""
    import numpy as np
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=(vocab, 4))
    toks = [int(rng.integers(0, vocab))]
    for _ in range(n - 1):
        toks.append(int(succ[toks[-1], rng.integers(0, 4)]) if rng.random() < 0.9 else int(rng.integers(0, vocab)))
    write_shard(os.path.join(d, "train_000000.bin"), toks[:cut])
    write_shard(os.path.join(d, "train_000001.bin"), toks[cut:])
    return os.path.join(d, "train_*.bin")


def make_data(d, vocab, T):
    """35 sequences of T+1 tokens and 17 tokens over, so that with a global
    batch of 8 an epoch is 4 steps and 3 sequences are left out of each epoch,
    and windows straddle the shard boundary."""
    return markov_shards(d, vocab, 35 * T + 1 + 17, 1000, 19)


CONFIG = """\
# The trainer's recipe in full: warm-up then cosine to min_lr, clipping that
# acts on some steps, weight decay, two micro-batches per step.
[model]
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 500   # lattice pads wte to 512 rows
seq_len = 64

[train]
micro_batch_size = 4
grad_accum_steps = 2
steps = 10
seed = 1337
threads = 1

[optim]
lr = {lr}
min_lr = {min_lr}
warmup_steps = 3
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
eps = {eps}
grad_clip = {grad_clip}

[precision]
compute = "{compute}"

[data]
train = "{train}"

[checkpoint]
dir = "{ckpt}"
init_from = "{init_from}"

[log]
every = 1
metrics_file = "{metrics}"
"""


def run_lattice(lattice, config, work, log):
    env = dict(os.environ, LATTICE_PEAK_GFLOPS_PER_CORE="100", LATTICE_CACHE_DIR=work, OMP_NUM_THREADS="1")
    t0 = time.time()
    p = subprocess.run([lattice, "train", "-c", config], env=env, capture_output=True, text=True)
    with open(os.path.join(work, "lattice.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"lattice train -c {config} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    log(f"  lattice train: {time.time() - t0:.1f} s")


def case(name, args, tool, work, data, compute, init_from, optim, log):
    d = os.path.join(work, name)
    os.makedirs(d)
    paths = {"train": data, "ckpt": os.path.join(d, "ckpt"), "metrics": os.path.join(d, "metrics.jsonl"),
             "init_from": init_from, "compute": compute, **optim}
    config = os.path.join(d, "run.toml")
    with open(config, "w") as f:
        f.write(CONFIG.format(**paths))
    log(f"[{name}] precision.compute={compute}, init {'from ' + init_from if init_from else 'lattice seed 1337'}, "
        + ", ".join(f"optim.{k}={v}" for k, v in optim.items()))
    run_lattice(args.lattice, config, d, log)
    t0 = time.time()
    cfg = tool.load_config(config)
    result = tool.train(cfg, threads=1)
    tool.write_outputs(result, cfg, os.path.join(d, "torch"))
    rep = tool.compare(result, cfg, paths["metrics"], paths["ckpt"])
    log(f"  torch reference: {time.time() - t0:.1f} s")

    failures = list(rep["failures"])
    # The run must exercise what it claims to: clipping on some steps but not
    # all, an epoch boundary, and non-zero weight decay on the decayed tensors.
    steps = result["steps"]
    clipped = [r["step"] for r in steps if r["clip_scale"] < 1.0]
    if not clipped or len(clipped) == len(steps):
        failures.append(f"grad_clip={optim['grad_clip']} clips on steps {clipped}: the test needs some steps clipped "
                        "and some not")
    if max(r["epoch"] for r in steps) < 1:
        failures.append("the run never crosses an epoch boundary")
    if cfg["optim.weight_decay"] <= 0:
        failures.append("weight decay is off")
    log(f"  clipped on steps {clipped}; epochs {sorted({r['epoch'] for r in steps})}")
    log("  step  lattice loss   torch loss     rel diff   grad-norm rel")
    for s in rep.get("per_step", []):
        log(f"  {s['step']:4d}  {s['lattice_loss']:.7f}  {s['torch_loss']:.7f}  {s['loss_rel']:.2e}   "
            f"{s['grad_norm_rel']:.2e}")
    tol, mr = rep["tolerances"], rep.get("max_rel", {})

    def e(value):
        return "n/a" if value is None else f"{value:.2e}"
    log(f"  max relative diff: loss {e(mr.get('loss'))} (tol {tol['loss_rtol']:g}), lr {e(mr.get('lr'))} "
        f"(tol {tol['lr_rtol']:g}), grad norm {e(mr.get('grad_norm'))} (tol {tol['norm_rtol']:g}; "
        f"step 1 {e(rep.get('first_norm_rel'))}, tol {tol['first_norm_rtol']:g})")
    log(f"  parameters: max |diff| {e(rep.get('param_max_abs'))} in {rep.get('param_max_abs_in')} "
        f"(tol {tol['param_atol']:g}), rel L2 {e(rep.get('param_rel_l2'))} in {rep.get('param_rel_l2_in')} "
        f"(tol {tol['param_rel_l2']:g})")
    log(f"  K biases: max |diff| {e(rep.get('kbias_max_abs'))} (tol {tol['kbias_atol']:g}); Adam moments: rel L2 "
        f"{e(rep.get('moment_rel_l2'))} in {rep.get('moment_rel_l2_in')} (tol {tol['moment_rel_l2']:g})")
    with open(os.path.join(d, "report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    for msg in failures:
        log(f"  MISMATCH {msg}")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lattice", required=True, help="the lattice executable")
    ap.add_argument("--tools", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    ap.add_argument("--only", choices=["f32", "bf16"], help="run one case")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(f"SKIP: PyTorch cannot be imported by {sys.executable} ({e}); "
              "install Debian's python3-torch (scripts/setup.sh does)")
        return SKIP
    sys.path.insert(0, os.path.abspath(args.tools))
    import gpt2_reference as ref_model
    import torch_train_reference as tool

    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(tool.selftest())
    work = args.keep or tempfile.mkdtemp(prefix="lattice_torch_ref_")
    if args.keep:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    try:
        data = make_data(work, vocab=500, T=64)
        failures = []
        if args.only in (None, "f32"):
            failures += case("f32", args, tool, work, data, "f32", "",
                             {"lr": 1e-2, "min_lr": 1e-3, "eps": 1e-8, "grad_clip": 1.0}, log)
        if args.only in (None, "bf16"):
            # Non-trivial initial values for every tensor (LayerNorm weights and
            # biases too), given to both through checkpoint.init_from.
            m = ref_model.build_model(ref_model.GPT2Config(2, 4, 64, 500, 64))
            ref_model.init_params(m, seed=19)
            init = os.path.join(work, "init.safetensors")
            ref_model.save_safetensors(m, init)
            # A gentler recipe than f32's: at lr 1e-2 two bf16 runs that differ
            # only in summation order drift 1% apart within 10 steps (either
            # side's own GEMM paths do); eps 1e-5 keeps Adam from turning
            # rounding noise in near-zero gradients into full-size steps.
            failures += case("bf16", args, tool, work, data, "bf16", init,
                             {"lr": 3e-3, "min_lr": 3e-4, "eps": 1e-5, "grad_clip": 0.75}, log)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    log(f"{'FAIL' if failures else 'PASS'} ({time.time() - t0:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
