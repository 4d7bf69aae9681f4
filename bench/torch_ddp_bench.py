#!/usr/bin/python3
"""PyTorch DistributedDataParallel CPU training-step benchmark: the data-parallel reference for lattice.

    /usr/bin/python3 bench/torch_ddp_bench.py --ranks 2 --threads 1 --n-layer 12 --n-head 12 \\
        --n-embd 768 --vocab 50257 --batch 4 --seq 256 --steps 5 --warmup 2 [--bucket-mb 25]

What a user on one machine would pick instead of lattice's data parallelism:
torch.nn.parallel.DistributedDataParallel over the gloo backend, Debian's
python3-torch, default DDP settings but the bucket size (--bucket-mb, DDP's
bucket_cap_mb; --grad-as-bucket-view turns on gradient_as_bucket_view).

Processes. The script starts --ranks children itself (subprocess), each with
MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port, RANK, WORLD_SIZE, and joins
them with init_method="env://" — Debian's torchrun fails here, ranks started by
hand work. The parent never imports torch. If a child exits with an error, or
the whole run passes --timeout seconds, every child is killed (SIGTERM, then
SIGKILL) and the script exits 1 with one line naming the rank and why; gloo's
own timeout is set to the same --timeout, so a rank whose peer died stops too.
Children write their messages to stderr prefixed with their rank; rank 0
prints the JSON line, which the parent passes on as its only stdout.

Ranks on several hosts (bench/cluster_bench.sh runs one per node of an
emulated cluster): --rank R starts only rank R of --ranks, with MASTER_ADDR =
--master-addr (rank 0's host, an address every rank reaches) and MASTER_PORT =
--master-port (required then: the ranks must agree on it). Start the same
command line on each host with its own --rank; rank 0's prints the JSON, the
others print nothing. gloo picks its interface from the host's name, or from
GLOO_SOCKET_IFNAME when set.

--ranks 1 is DDP over a one-rank gloo group, not a plain process: the ratio
ranks=2 / ranks=1 then measures the scaling of one code path (hooks, bucket
copies and all), and DDP's own cost at one rank shows against
bench/torch_gpt2_bench.py, which is the plain single process (the dp=1 row
bench/compare_dp.sh prints for PyTorch).

One step, on every rank = forward + backward (DDP all-reduces the gradient
buckets as backward produces them) + AdamW step, fp32, no gradient
accumulation, no clipping: the model and recipe of bench/torch_gpt2_bench.py
(tools/gpt2_reference.py, AdamW lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0.1 on tensors of dim >= 2). Every rank builds the same initial model
(DDP also broadcasts rank 0's) and trains on its own fixed random batch of
--batch sequences (seed + 1 + rank). After the warm-up steps the ranks meet at
a barrier; each timed step's time is the slowest rank's.

Threads and BLAS: as bench/torch_gpt2_bench.py (bench/torch_blas.py picks
OpenBLAS and its core type for --threads threads; each child gets
OPENBLAS_CORETYPE, OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = --threads,
OMP_WAIT_POLICY=PASSIVE, OPENBLAS_L2_SIZE, GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
and every child refuses to run (one message, exit 1) unless torch maps
OpenBLAS with the chosen core, torch and OpenBLAS both run --threads threads
and a 1024x768x3072 GEMM reaches
--min-gemm-gflops-per-thread x --threads GFLOP/s. --ranks x --threads above the
CPUs this process may use is refused unless --oversubscribe (then the JSON
says "oversubscribed": true and its speed means little).

--steps-file FILE: rank 0 appends {"step": i, "step_ms": its own step time} to FILE after every
step, warm-up steps included, as lattice's log.metrics_file does (bench/cluster_row.py reads the
link's byte counters when each line appears).

Prints one JSON line:
  {"impl": "pytorch-ddp", "ranks", "threads", "tokens_per_sec", "step_ms", "peak_rss_bytes",
   "peak_rss_bytes_max", "model_state_bytes", "threads_observed", ...}
  tokens_per_sec   global: ranks x batch x seq / mean step time (best step: tokens_per_sec_best)
  step_ms          mean over the timed steps of the slowest rank's step (median, min too)
  peak_rss_bytes   rank 0's resource.getrusage(RUSAGE_SELF).ru_maxrss at the end (the whole
                   process: libtorch, the Python interpreter, gloo's buffers); _max over ranks
  model_state_bytes per rank, from tensor sizes: params_bytes (unique parameters) + grads_bytes
                   (their .grad after a step) + optimizer_bytes (AdamW's state tensors)
  ddp_bucket_bytes the gradient buckets DDP keeps beside .grad (0 with --grad-as-bucket-view, where
                   .grad are views into them), from the sizes of the parameters DDP reduces
  threads_observed rank 0's process CPU time / wall time over the timed steps (_min over ranks);
                   a warning when below 0.75 x --threads
  ddp_*            what DDP's logger measured itself: the bucket sizes of the timed steps (after DDP's
                   rebuild in gradient-ready order) and the mean forward, backward compute, backward
                   communication and overlap times in ms (torch 1.13 records them on CPU too,
                   averaged over the iterations its logger samples, warm-up ones included)
"""

import argparse
import datetime
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_blas  # noqa: E402

CHILD_MARK = "LATTICE_TORCH_DDP_CHILD"
SETUP_VAR = "LATTICE_TORCH_DDP_SETUP"  # the parent's torch_blas.prepare() result, as JSON, for the children
PROG = "torch_ddp_bench.py"


def add_launch_args(ap):
    """The options of the hand-started ranks (bench/torch_ddp_hooks.py takes them too)."""
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds the whole run may take before every rank is killed (default 1800); also "
                         "gloo's timeout")
    ap.add_argument("--oversubscribe", action="store_true",
                    help="allow --ranks x --threads above the CPUs available (speed then means little)")
    ap.add_argument("--rank", type=int, default=None,
                    help="start only this rank of --ranks (ranks on several hosts: run the same command on each "
                         "with its own --rank; needs --master-port)")
    ap.add_argument("--master-addr", default="127.0.0.1",
                    help="rank 0's address, which every rank connects to (default 127.0.0.1)")
    ap.add_argument("--master-port", type=int, default=None,
                    help="rank 0's port (default: a free one; required with --rank)")


def check_launch_args(args):
    """One clear line for a launch option that cannot work (exit 1)."""
    if args.rank is not None and not 0 <= args.rank < args.ranks:
        fail(f"--rank {args.rank} is invalid: a rank of --ranks {args.ranks}, 0 to {args.ranks - 1}")
    if args.rank is not None and args.master_port is None:
        fail("--rank needs --master-port: every rank, started separately, must be told the same port")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        fail(f"--master-port {args.master_port} is invalid: a TCP port, 1 to 65535")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes, one DDP rank each (default 2)")
    torch_blas.add_step_benchmark_args(ap, batch_help="sequences per rank per step", threads_help="threads per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25, DDP's own)")
    ap.add_argument("--grad-as-bucket-view", action="store_true",
                    help="DDP gradient_as_bucket_view=True (.grad are views into the buckets; default off, "
                         "as in DDP)")
    ap.add_argument("--steps-file",
                    help="rank 0 appends a line {\"step\": i, \"step_ms\": ...} to this file after each step, "
                         "warm-up ones included (bench/cluster_row.py reads the link's counters at each)")
    add_launch_args(ap)
    args = ap.parse_args()
    torch_blas.check_step_benchmark_args(ap, args, positive=("ranks", "bucket_mb", "timeout"))
    return args


def fail(msg):
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# Parent: set up OpenBLAS once, start the ranks, watch them

def free_port():
    """A TCP port nobody listens on now (rank 0's store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Terminated(Exception):
    pass


def stop_all(procs):
    """SIGTERM every child still running, SIGKILL what is left after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_reason(code):
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def parent_main(args, script=None):
    """Starts --ranks copies of `script` (default: this file) with the same command line, as DDP ranks.
    bench/torch_ddp_hooks.py reuses it for its own children. With --rank, only that rank."""
    from torch_gpt2_bench import tuned_env  # the same environment as the single-process reference

    check_launch_args(args)
    mine = [args.rank] if args.rank is not None else list(range(args.ranks))  # the ranks started here
    cpus = torch_blas.usable_cpus()
    oversubscribed = len(mine) * args.threads > cpus
    if oversubscribed and not args.oversubscribe:
        fail(f"{len(mine)} rank(s) x --threads {args.threads} = {len(mine) * args.threads} threads on the "
             f"{cpus} CPUs this process may use: the reference would be timed oversubscribed (pass "
             "--oversubscribe to run it anyway)")
    try:
        # Per rank the thread count is --threads; prepare() refuses more threads than CPUs.
        setup = torch_blas.prepare(args.threads, args.coretype, args.recalibrate)
    except torch_blas.SetupError as e:
        fail(str(e))
    env = torch_blas.blas_env(setup["openblas_coretype"], args.threads)
    env[CHILD_MARK] = "1"
    env[SETUP_VAR] = json.dumps(dict({k: setup[k] for k in ("openblas_coretype", "openblas_coretype_gflops",
                                                            "openblas_coretype_source", "openblas_auto_core",
                                                            "cpu")}, oversubscribed=oversubscribed))
    tuned_env(env)  # OMP_WAIT_POLICY=PASSIVE, OPENBLAS_L2_SIZE: see torch_gpt2_bench.py
    port = args.master_port if args.master_port is not None else free_port()
    env.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks))
    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):  # left over from a launcher, they would confuse the ranks
        env.pop(k, None)

    def on_signal(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    procs = []
    cmd = [sys.executable, os.path.abspath(script or __file__)] + sys.argv[1:]
    try:
        for r in mine:
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r)),
                                          stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True))
        # Rank 0's only stdout is its JSON line at the end; read it when rank 0 is done (a pipe this small
        # never fills). Poll the others meanwhile, so that one rank's failure stops the run at once.
        deadline = time.monotonic() + args.timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [(mine[i], c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                stop_all(procs)
                fail(f"rank {r} of {args.ranks} failed ({exit_reason(c)}; its messages are above); "
                     "stopped the other ranks, no result")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [mine[i] for i, c in enumerate(codes) if c is None]
                stop_all(procs)
                fail(f"ranks {running} of {args.ranks} still running after --timeout {args.timeout:g} s; "
                     "killed them all, no result")
            time.sleep(0.05)
        out = procs[0].stdout.read() if mine[0] == 0 else None
    except (KeyboardInterrupt, Terminated) as e:
        stop_all(procs)
        fail(f"interrupted ({e or 'SIGINT'}); stopped all ranks")
    if out is None:  # a rank other than 0: rank 0's process prints the result
        return
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if not lines:
        fail("rank 0 finished without printing a result")
    print(lines[-1], flush=True)


# ---------------------------------------------------------------------------------------------
# Child: one DDP rank

def rank_fail(rank, msg):
    print(f"{PROG} rank {rank}: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def check_blas(torch, args, setup, rank):
    """torch_gpt2_bench.py's refusals, in this rank's process."""
    try:
        got = torch_blas.check_loaded_blas(torch, args.threads, setup["openblas_coretype"])
    except torch_blas.SetupError as e:
        rank_fail(rank, str(e))
    m, k, n = torch_blas.GEMM_SHAPES[0]
    rate = torch_blas.gemm_rate(torch, m, k, n, reps=3)
    floor = args.min_gemm_gflops_per_thread * args.threads
    if rate < floor and not setup["oversubscribed"]:
        rank_fail(rank, f"torch.matmul {m}x{k}x{n} ran at {rate:.1f} GFLOP/s on {args.threads} thread(s) with "
                        f"{got['blas_library']} ({got['blas_config']}, core {got['blas_core']}), below the "
                        f"--min-gemm-gflops-per-thread {args.min_gemm_gflops_per_thread:g} x {args.threads} = "
                        f"{floor:g} that any usable OpenBLAS reaches; not a fair reference, no result printed")
    return {"blas": got["blas_config"], "blas_core": got["blas_core"], "blas_threads": got["openblas_threads"],
            "blas_library": got["blas_library"], "gemm_check_gflops": rate}


def tensor_bytes(tensors):
    """Bytes of distinct tensors (a tensor reached twice, like the tied wte, counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def ddp_logged(ddp):
    """DDP's own measurements, where this torch keeps them (names and units differ between versions)."""
    try:
        d = ddp._get_ddp_logging_data()
    except Exception:  # a private API; its absence costs only these extra figures
        return {}
    out = {}
    # DDP assigns buckets at construction in parameter order ("bucket_sizes"), then rebuilds them after
    # the first backward in the order the gradients became ready ("rebuilt_bucket_sizes"): the buckets
    # the timed steps used.
    for key, name in (("rebuilt_bucket_sizes", "ddp_bucket_sizes_bytes"), ("bucket_sizes", "ddp_initial_bucket_sizes_bytes")):
        if d.get(key):
            out[name] = [int(x) for x in str(d[key]).split(",") if x.strip()]
    for key in ("avg_backward_compute_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time",
                "avg_forward_compute_time"):
        if d.get(key):  # nanoseconds
            out["ddp_" + key.replace("avg_", "").replace("_time", "_ms")] = d[key] / 1e6
    for key in ("comm_hook", "bucket_cap_bytes", "gradient_as_bucket_view", "static_graph"):
        if key in d:
            out["ddp_" + key] = d[key]
    return out


def child_main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup = json.loads(os.environ[SETUP_VAR])

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import gpt2_reference as ref

    info = check_blas(torch, args, setup, rank)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)

    cfg = ref.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         vocab_size=args.vocab, n_positions=args.seq)
    model = ref.build_model(cfg)
    ref.init_params(model, seed=args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.grad_as_bucket_view)
    decay = [p for n, p in model.named_parameters() if ref.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not ref.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, foreach=(args.foreach == "on"))

    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    params = list(model.parameters())  # unique Parameters (the tied wte once)
    params_bytes = tensor_bytes(params)
    grads_bytes = optimizer_bytes = 0
    times, losses = [], []
    cpu0 = wall0 = None
    steps_file = open(args.steps_file, "a") if args.steps_file and rank == 0 else None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()  # the timed steps start together on every rank
            cpu0, wall0 = time.process_time(), time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ref.forward_loss(ddp, x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i == 0:  # gradients and optimizer state exist now; zero_grad(set_to_none) frees .grad next step
            grads_bytes = tensor_bytes([p.grad for p in params])
            optimizer_bytes = tensor_bytes([t for s in opt.state.values() for t in s.values()
                                            if torch.is_tensor(t)])
        if i >= args.warmup:
            times.append(dt)
        if steps_file:
            steps_file.write(json.dumps({"step": i + 1, "step_ms": dt * 1e3}) + "\n")
            steps_file.flush()
    wall = time.perf_counter() - wall0
    if steps_file:
        steps_file.close()
    threads_observed = (time.process_time() - cpu0) / wall
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if threads_observed < 0.75 * args.threads:
        print(f"{PROG} rank {rank}: warning: asked for {args.threads} threads, {threads_observed:.2f} ran on "
              "average during the timed steps (CPU time / wall time): other load on the machine, or steps too "
              "small to spread over the threads?", file=sys.stderr, flush=True)

    # Each step took as long as its slowest rank; memory and threads of every rank.
    step_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
    mine = torch.tensor([rss, threads_observed, losses[-1]], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    logged = ddp_logged(ddp)
    bucket_bytes = 0 if args.grad_as_bucket_view else tensor_bytes([p for p in params if p.requires_grad])
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return

    times = step_t.tolist()
    n_params = ref.count_params(model) - model.wpe.weight.numel()
    flops_per_token = 6 * n_params + 12 * args.n_layer * args.n_embd * args.seq
    tokens_per_step = world * args.batch * args.seq
    step_s = statistics.mean(times)
    tokens_per_sec = tokens_per_step / step_s
    out = {
        "impl": "pytorch-ddp",
        "ranks": world,
        "threads": args.threads,
        "tokens_per_sec": tokens_per_sec,
        "step_ms": step_s * 1e3,
        "model_flops_per_sec": flops_per_token * tokens_per_sec,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tokens_per_sec_best": tokens_per_step / min(times),
        "peak_rss_bytes": int(every[0][0]),
        "peak_rss_bytes_max": int(max(t[0] for t in every)),
        "peak_rss_bytes_by_rank": [int(t[0]) for t in every],
        "model_state_bytes": params_bytes + grads_bytes + optimizer_bytes,
        "params_bytes": params_bytes, "grads_bytes": grads_bytes, "optimizer_bytes": optimizer_bytes,
        "ddp_bucket_bytes": bucket_bytes,
        "threads_observed": threads_observed,
        "threads_observed_min": min(float(t[1]) for t in every),
        "oversubscribed": setup["oversubscribed"],
        "backend": dist.Backend.GLOO, "init_method": "env://",
        "bucket_mb": args.bucket_mb, "gradient_as_bucket_view": args.grad_as_bucket_view,
        "flops_per_token": flops_per_token,
        "n_params": n_params,
        "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "vocab_size": args.vocab,
        "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "warmup": args.warmup,
        "loss_first": losses[0], "loss_last": losses[-1],
        "loss_last_by_rank": [float(t[2]) for t in every],
        "adamw_foreach": args.foreach == "on",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cpu": setup["cpu"],
        "openblas_coretype": setup["openblas_coretype"],
        "openblas_coretype_gflops": setup["openblas_coretype_gflops"],
        "openblas_coretype_source": setup["openblas_coretype_source"],
        "openblas_auto_core": setup["openblas_auto_core"],
        "openblas_l2_size_env": os.environ.get("OPENBLAS_L2_SIZE"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        **logged,
        **info,
    }
    print(json.dumps(out), flush=True)


def main():
    args = parse_args()
    if os.environ.get(CHILD_MARK) == "1":
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
