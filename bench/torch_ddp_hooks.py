#!/usr/bin/python3
"""PyTorch DDP's gradient-compression communication hooks, trained on the same model, weights and
batches as a lattice run: the reference rows of bench/compress_table.sh.

    /usr/bin/python3 bench/torch_ddp_hooks.py --write-init FILE [model options] [--seed S]
    /usr/bin/python3 bench/torch_ddp_hooks.py --ranks 2 --hook fp16 --init FILE \\
        --train 'data/moby/train_*.bin' --val 'data/moby/val_*.bin' --steps 100 [options]

--hook (torch 1.13's torch.distributed.algorithms.ddp_comm_hooks):
  allreduce  no hook: DDP's built-in f32 all-reduce of its buckets
  fp16       default_hooks.fp16_compress_hook: each bucket cast to float16, all-reduced, cast back
  bf16       default_hooks.bf16_compress_hook: the same with bfloat16
  powersgd   powerSGD_hook.powerSGD_hook with PowerSGDState(matrix_approximation_rank=--powersgd-rank,
             start_powerSGD_iter=--powersgd-start, use_error_feedback=True, warm_start=True, DDP's
             default min_compression_rate 2): each gradient viewed as a matrix (rows = its first
             dimension) is sent as P [rows, r] and Q [cols, r]; 1-D tensors and matrices that would
             not shrink 2x are all-reduced uncompressed in f32. The hook needs start >= 2 (vanilla
             all-reduce before).
  bf16-unchecked  bf16_compress_hook called through a wrapper, so that DDP's check for CUDA 11+
             and NCCL 2.10+ (which refuses the hook itself on CPU) does not recognise it: does gloo
             reduce bfloat16?
  powersgd-sync  powersgd, with each bucket's future waited for inside the hook. powerSGD_hook posts
             the P and Q all-reduces from callbacks on gloo's threads while the next bucket's hook
             posts its own from the main thread, so the ranks can post them in different orders; gloo
             pairs collectives by the order they were posted, and a rank then receives a payload of
             another size (gloo::EnforceNotMet, op.preamble.length <= op.nbytes, SIGABRT). Waiting
             serialises the buckets (no overlap of communication with the backward) and runs.
None of them has lattice's error feedback except PowerSGD (fp16/bf16 round to nearest, the
error is dropped).

Processes, BLAS setup, --threads, --timeout and --oversubscribe: as bench/torch_ddp_bench.py,
whose launcher this script uses (ranks started by hand with env://, gloo; a rank that fails
stops the run, the parent exits 1 naming it; the rank's own error is on stderr above).

The same run as lattice's `train` with data.train/data.val set, model.init_from = the --init
file, train.micro_batch_size = --batch, train.seed = --data-seed, parallel.dp = --ranks:
  - Data: lattice's sampler (src/lattice/data/loader.h), reimplemented: the shards' tokens in
    sorted file order, sequence i = tokens [i*T, i*T+T], each epoch a Fisher-Yates permutation
    from lattice's Philox4x32-10 stream (seed, 0xDA7A000000000000 + epoch); step k gives rank r
    the --batch sequences from k*ranks*batch + r*batch. Validation: the same without shuffling,
    --eval-steps batches per rank from the start, after the last step.
  - Optimizer: AdamW (betas 0.9/0.95, eps 1e-8, weight decay --weight-decay on tensors of dim >= 2),
    lattice's schedule (linear warm-up to --lr over --lr-warmup steps, cosine to --min-lr at the
    last step), the averaged gradient's global L2 norm clipped to --grad-clip.
  - --write-init FILE writes GPT-2's initialisation (weights N(0, 0.02), the residual
    projections' N(0, 0.02/sqrt(2 n_layer)), biases 0, LayerNorm weights 1) from torch.Generator
    seed --seed, as a safetensors file both lattice (model.init_from) and this script (--init) load.
With the allreduce hook the loss follows lattice's uncompressed run to float rounding
(step 1 equal to ~1e-6), which checks the data order and the initial weights.

Bytes: what each rank sends per step, by the ring accounting lattice's metrics use
(grad_bytes): an all-reduce of b bytes over n ranks sends 2(n-1)/n x b. The hooks' payloads are
measured (every torch.distributed.all_reduce a hook posts is counted); DDP's built-in all-reduce
is not visible from Python, so the allreduce row counts its buckets (every gradient, f32).
"uncompressed" is the f32 all-reduce of all gradients.

Prints one JSON line (rank 0):
  {"impl": "pytorch-ddp-hook", "hook", "ranks", "steps", "loss_first", "loss_last", "loss_by_step",
   "val_loss", "step_ms" (mean over the steps after --warmup of the slowest rank's step),
   "grad_bytes_per_step", "grad_bytes_uncompressed_per_step", "grad_share", "bytes_measured", ...}
"""

import argparse
import datetime
import glob
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_blas  # noqa: E402
import torch_ddp_bench as launcher  # noqa: E402

PROG = "torch_ddp_hooks.py"
launcher.PROG = PROG  # the launcher's messages name this script
HOOKS = ("allreduce", "fp16", "bf16", "bf16-unchecked", "powersgd", "powersgd-sync")
M32, M64 = (1 << 32) - 1, (1 << 64) - 1
SHUFFLE_STREAM = 0xDA7A000000000000  # lattice's DataLoader::kShuffleStream


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes, one DDP rank each (default 2)")
    torch_blas.add_step_benchmark_args(ap, batch_help="sequences per rank per step (lattice's micro_batch_size)",
                                       threads_help="threads per rank")
    ap.add_argument("--hook", choices=HOOKS, default="allreduce")
    ap.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix_approximation_rank (default 4)")
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="PowerSGD start_powerSGD_iter: steps of vanilla all-reduce first (default 2, the minimum)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25, DDP's own)")
    ap.add_argument("--init", help="safetensors file of the initial weights (from --write-init)")
    ap.add_argument("--write-init", metavar="FILE", help="write the initial weights (seed --seed) and exit")
    ap.add_argument("--train", help="glob of training .bin shards")
    ap.add_argument("--val", help="glob of validation .bin shards (none: no val_loss)")
    ap.add_argument("--data-seed", type=int, default=1337, help="lattice's train.seed: the epochs' order")
    ap.add_argument("--eval-steps", type=int, default=8, help="validation batches per rank (lattice's eval_steps)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    launcher.add_launch_args(ap)
    args = ap.parse_args()
    torch_blas.check_step_benchmark_args(ap, args, positive=("ranks", "bucket_mb", "timeout", "powersgd_rank",
                                                             "eval_steps"))
    if args.write_init is None:
        for k in ("init", "train"):
            if not getattr(args, k):
                ap.error(f"--{k} is required (or --write-init FILE)")
        if args.hook.startswith("powersgd") and args.powersgd_start < 2:
            ap.error("--powersgd-start must be >= 2 (PowerSGD with error feedback needs two vanilla steps)")
    return args


# ---------------------------------------------------------------------------------------------
# lattice's data order (src/lattice/core/rng.cpp, src/lattice/data/loader.cpp)

def philox4x32(key, ctr):
    k0, k1 = key
    c0, c1, c2, c3 = ctr
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


class Rng:
    """lattice::Rng: key (seed, stream + 0x5EED), a 64-bit block counter, words used from the back."""

    def __init__(self, seed, stream):
        k = ((seed * 0x9E3779B97F4A7C15) & M64) ^ ((stream + 0x5EED) & M64)
        self.key, self.counter, self.block = (k & M32, k >> 32), 0, []

    def next_u32(self):
        if not self.block:
            self.block = list(philox4x32(self.key, (self.counter & M32, self.counter >> 32, 0, 0)))
            self.counter += 1
        return self.block.pop()

    def next_below(self, n):
        limit = M64 - M64 % n  # rejection sampling, as lattice
        while True:
            hi = self.next_u32()
            x = (hi << 32) | self.next_u32()
            if x < limit:
                return x % n


def read_tokens(pattern):
    import numpy as np
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no file matches '{pattern}' (run scripts/setup.sh)")
    parts = []
    for f in files:
        header = np.fromfile(f, dtype="<i4", count=256)
        if header[0] != 20240520 or header[1] != 1:
            raise ValueError(f"{f}: not a version-1 token shard")
        parts.append(np.fromfile(f, dtype="<u2", offset=1024, count=int(header[2])))
    return np.concatenate(parts).astype(np.int64)


class Sampler:
    """One rank's batches, in lattice's order: [B, T+1] windows per step."""

    def __init__(self, tokens, T, B, rank, ranks, seed, shuffle):
        self.tokens, self.T, self.B, self.rank, self.ranks = tokens, T, B, rank, ranks
        self.seed, self.shuffle = seed, shuffle
        self.sequences = (len(tokens) - 1) // T
        self.steps = self.sequences // (ranks * B)
        if self.steps == 0:
            raise ValueError(f"{self.sequences} sequences of {T + 1} tokens, fewer than one step's {ranks * B}")
        self.epoch, self.position = 0, 0
        self.order = self._order()

    def _order(self):
        order = list(range(self.sequences))
        if self.shuffle:
            rng = Rng(self.seed, SHUFFLE_STREAM + self.epoch)
            for i in range(len(order), 1, -1):
                j = rng.next_below(i)
                order[i - 1], order[j] = order[j], order[i - 1]
        return order

    def next(self, torch):
        if self.position == self.steps:
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._order()
        first = self.position * self.ranks * self.B + self.rank * self.B
        rows = [self.tokens[self.order[first + b] * self.T:][:self.T + 1] for b in range(self.B)]
        self.position += 1
        w = torch.from_numpy(__import__("numpy").stack(rows))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def lr_at(step, total, warmup, max_lr, min_lr):
    """lattice's optim::lr_at."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if total <= warmup:
        return max_lr
    ratio = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


# ---------------------------------------------------------------------------------------------

def write_init(args):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import gpt2_reference as ref
    cfg = ref.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab,
                         n_positions=args.seq)
    model = ref.build_model(cfg)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * args.n_layer) if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith(".weight"):  # LayerNorm gains
                p.fill_(1.0)
            else:
                p.zero_()
    ref.save_safetensors(model, args.write_init, metadata={"init": f"gpt2 std 0.02, torch seed {args.seed}"})
    print(f"{PROG}: wrote {args.write_init}", file=sys.stderr)


def child_main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup = json.loads(os.environ[launcher.SETUP_VAR])

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import gpt2_reference as ref

    info = launcher.check_blas(torch, args, setup, rank)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))

    cfg = ref.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         vocab_size=args.vocab, n_positions=args.seq)
    model = ref.build_model(cfg)
    ref.load_safetensors(model, args.init)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)

    # Count the payload of every all-reduce a Python hook posts (they all call dist.all_reduce).
    posted = [0]
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):
        posted[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *a, **kw)

    dist.all_reduce = counting_all_reduce
    state = None
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.hook == "bf16-unchecked":
        ddp.register_comm_hook(None, lambda s, bucket: default_hooks.bf16_compress_hook(s, bucket))
    elif args.hook in ("powersgd", "powersgd-sync"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start, use_error_feedback=True,
                                            warm_start=True)
        if args.hook == "powersgd":
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            def serial(s, bucket):
                fut = powerSGD_hook.powerSGD_hook(s, bucket)
                fut.wait()
                return fut
            ddp.register_comm_hook(state, serial)

    decay = [p for n, p in model.named_parameters() if ref.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not ref.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=(args.foreach == "on"))
    train = Sampler(read_tokens(args.train), args.seq, args.batch, rank, world, args.data_seed, shuffle=True)

    ring = 2.0 * (world - 1) / world
    grad_f32_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    times, losses, sent = [], [], []
    for step in range(args.steps):
        x, y = train.next(torch)
        lr = lr_at(step, args.steps, args.lr_warmup, args.lr, args.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        posted[0] = 0
        opt.zero_grad(set_to_none=True)
        loss = ref.forward_loss(ddp, x, y)
        loss.backward()  # DDP averages the gradients over the ranks (through the hook) here
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        sent.append((posted[0] if args.hook != "allreduce" else grad_f32_bytes) * ring)
    dist.all_reduce = real_all_reduce

    val_loss = None
    if args.val:
        val = Sampler(read_tokens(args.val), args.seq, args.batch, rank, world, args.data_seed, shuffle=False)
        with torch.no_grad():
            total = sum(ref.forward_loss(model, *val.next(torch)).item() for _ in range(args.eval_steps))
        v = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(v)
        val_loss = v.item() / (args.eval_steps * world)

    step_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= world
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    timed = step_t.tolist()[args.warmup:] or step_t.tolist()
    by_step = loss_t.tolist()
    out = {
        "impl": "pytorch-ddp-hook", "hook": args.hook, "ranks": world, "threads": args.threads,
        "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "loss_first": by_step[0], "loss_last": by_step[-1], "loss_by_step": by_step, "val_loss": val_loss,
        "step_ms": statistics.mean(timed) * 1e3, "step_ms_median": statistics.median(timed) * 1e3,
        "timed_steps": len(timed),
        "grad_bytes_per_step": statistics.mean(sent), "grad_bytes_last_step": sent[-1],
        "grad_bytes_uncompressed_per_step": grad_f32_bytes * ring,
        "grad_share": statistics.mean(sent) / (grad_f32_bytes * ring),
        "bytes_measured": args.hook != "allreduce",
        "powersgd_rank": args.powersgd_rank if state else None,
        "powersgd_start": args.powersgd_start if state else None,
        "oversubscribed": setup["oversubscribed"], "backend": "gloo", "init_method": "env://",
        "bucket_mb": args.bucket_mb, "torch": torch.__version__, "cpu": setup["cpu"],
        **info,
    }
    print(json.dumps(out), flush=True)


def main():
    args = parse_args()
    if args.write_init:
        write_init(args)
    elif os.environ.get(launcher.CHILD_MARK) == "1":
        child_main(args)
    else:
        launcher.parent_main(args, script=__file__)


if __name__ == "__main__":
    main()
