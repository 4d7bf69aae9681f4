#!/usr/bin/python3
"""PyTorch CPU GPT-2 training-step benchmark: the reference lattice is compared with.

    /usr/bin/python3 bench/torch_gpt2_bench.py --n-layer 12 --n-head 12 --n-embd 768 \\
        --vocab 50257 --batch 4 --seq 256 --threads 2 --steps 5 --warmup 2

One step = forward + backward + AdamW step (fp32, no grad accumulation, no
clipping), the model of tools/gpt2_reference.py, one fixed random batch.
Prints one JSON line:
  {"impl": "pytorch", "tokens_per_sec", "step_ms", "model_flops_per_sec", ...}
step_ms is the mean over the timed steps (median and min are printed too);
tokens_per_sec = B*T / mean step time.

Model FLOPs per token (nanoGPT / PaLM convention, no causal discount):
    flops_per_token = 6*N + 12*n_layer*n_embd*seq
  N = all parameters except the position embedding (a lookup, not a product),
  the tied wte counted once (it is the LM head's weight): wte + blocks + ln_f.
  The same formula as lattice's ModelConfig::flops_per_token.
  6N: 2 FLOPs per multiply-add, x3 for forward + backward (dX and dW).
  12*L*C*T: attention scores Q K^T and the weighted sum P V, each 2*T*C FLOPs
  per token forward, x3 for forward + backward.
model_flops_per_sec = flops_per_token * tokens_per_sec.

PyTorch at its best on this machine: torch's BLAS here is Debian's OpenBLAS
0.3.21 (DYNAMIC_ARCH), which detects this CPU (Xeon, family 6 model 207) as
Prescott and runs sgemm at ~30 GFLOP/s/core instead of ~145 with the AVX-512
SkylakeX kernels. So the script re-executes itself with OPENBLAS_CORETYPE
(default SkylakeX, --coretype to change), OPENBLAS_NUM_THREADS and
OMP_NUM_THREADS = --threads, and OPENBLAS_L2_SIZE = this CPU's per-core L2 in
bytes (0.3.21 does not read that variable; it is set so that a value left in
the environment for other tools does not describe another CPU). These apply to
this benchmark's process only. The JSON reports the OpenBLAS core it got.
"""

import argparse
import json
import os
import statistics
import sys
import time

CHILD_MARK = "LATTICE_TORCH_BENCH_CHILD"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--coretype", default="SkylakeX", help="OPENBLAS_CORETYPE for this run")
    ap.add_argument("--foreach", choices=["on", "off"], default="off",
                    help="torch.optim.AdamW foreach implementation (default off, torch 1.13's CPU default; "
                         "on was not faster here)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for k in ("n_layer", "n_head", "n_embd", "vocab", "batch", "seq", "threads", "steps"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.n_embd % args.n_head:
        ap.error(f"--n-head {args.n_head} does not divide --n-embd {args.n_embd}")
    return args


def l2_bytes():
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            s = f.read().strip()
        mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1], 1)
        return int(s.rstrip("KM")) * mult
    except (OSError, ValueError):
        return None


def reexec_with_blas_env(args):
    """Env vars must be set before OpenBLAS is loaded, i.e. before `import torch`."""
    if os.environ.get(CHILD_MARK) == "1":
        return
    env = dict(os.environ)
    env[CHILD_MARK] = "1"
    env["OPENBLAS_CORETYPE"] = args.coretype
    env["OPENBLAS_NUM_THREADS"] = str(args.threads)
    env["OMP_NUM_THREADS"] = str(args.threads)
    l2 = l2_bytes()
    if l2:
        env["OPENBLAS_L2_SIZE"] = str(l2)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def blas_info():
    import ctypes
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        return {"blas": lib.openblas_get_config().decode(), "blas_core": lib.openblas_get_corename().decode(),
                "blas_threads": lib.openblas_get_num_threads(), "_lib": lib}
    except (OSError, AttributeError):
        return {"blas": "unknown", "blas_core": "unknown", "blas_threads": None, "_lib": None}


def main():
    args = parse_args()
    reexec_with_blas_env(args)

    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import gpt2_reference as ref

    torch.set_num_threads(args.threads)
    info = blas_info()
    if info["_lib"] is not None:
        info["_lib"].openblas_set_num_threads(args.threads)
        info["blas_threads"] = info["_lib"].openblas_get_num_threads()
    del info["_lib"]

    cfg = ref.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         vocab_size=args.vocab, n_positions=args.seq)
    model = ref.build_model(cfg)
    ref.init_params(model, seed=args.seed)
    decay = [p for n, p in model.named_parameters() if ref.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not ref.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, foreach=(args.foreach == "on"))

    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ref.forward_loss(model, x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(dt)

    n_params = ref.count_params(model) - model.wpe.weight.numel()
    flops_per_token = 6 * n_params + 12 * args.n_layer * args.n_embd * args.seq
    step_s = statistics.mean(times)
    tokens_per_sec = args.batch * args.seq / step_s
    out = {
        "impl": "pytorch",
        "tokens_per_sec": tokens_per_sec,
        "step_ms": step_s * 1e3,
        "model_flops_per_sec": flops_per_token * tokens_per_sec,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tokens_per_sec_best": args.batch * args.seq / min(times),  # fastest step: least disturbed by other load
        "flops_per_token": flops_per_token,
        "n_params": n_params,
        "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "vocab_size": args.vocab,
        "batch": args.batch, "seq": args.seq, "threads": args.threads,
        "steps": args.steps, "warmup": args.warmup,
        "loss_first": losses[0], "loss_last": losses[-1],
        "adamw_foreach": args.foreach == "on",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
        "openblas_l2_size_env": os.environ.get("OPENBLAS_L2_SIZE"),
        **info,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
