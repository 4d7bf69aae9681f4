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

PyTorch at its best on the CPU at hand (bench/torch_blas.py does the setup;
its docstring says why each step is needed):
  - torch must run on OpenBLAS, not Debian's reference libblas.so.3 (one
    thread, ~8 GFLOP/s): libopenblas0-pthread (and python3-torch) are
    installed with apt-get when missing and the libblas.so.3 alternative is
    pointed at OpenBLAS. If torch still does not map OpenBLAS, the script exits
    1 and prints no result.
  - OpenBLAS 0.3.21's own kernel pick misreads CPUs newer than it (Emerald
    Rapids came out as Prescott), so OPENBLAS_CORETYPE is chosen by timing
    the candidates the CPU's flags allow (SkylakeX, Cooperlake with
    avx512_bf16, Haswell, Zen) on GPT-2's MLP GEMMs at --threads threads, and
    the fastest is cached per CPU and thread count in
    ~/.cache/lattice/openblas_coretype.json. --coretype NAME forces one,
    --recalibrate measures again.
The script then re-executes itself with OPENBLAS_CORETYPE, OPENBLAS_NUM_THREADS
and OMP_NUM_THREADS = --threads, OMP_WAIT_POLICY=PASSIVE (unless the
environment sets it), and OPENBLAS_L2_SIZE = this CPU's per-core L2 in bytes
(0.3.21 does not read that variable; it is set so that a value left in the
environment for other tools does not describe another CPU). These apply to
this benchmark's process only.
Why PASSIVE: torch's own ops run on libgomp's threads and its GEMMs on
libopenblas0-pthread's, two pools that each spin-wait after their work. With
as many threads as cores, the idle pool's spinning takes the cores the busy
one needs: at 2 threads on a 2-core Zen 5 VM, the L6-C384-B8-T256 row ran at
625-700 tokens/s with libgomp spinning (its default) and 830-960 passive, and
gpt2-124M-B4-T64 at 106-133 against 170-185 (1 thread: no difference).
(Debian's libopenblas0-openmp, which runs the GEMMs on torch's own OpenMP
pool, measured about the same as pthread + PASSIVE.)

In the re-executed process, before building the model, it refuses to run
(exit 1, one message) unless:
  - the BLAS torch maps is OpenBLAS, running the chosen core type;
  - torch.get_num_threads() and openblas_get_num_threads() both equal --threads;
  - torch.matmul at 1024x768 . 768x3072 reaches --min-gemm-gflops-per-thread
    x --threads GFLOP/s (default 20 per thread: the reference BLAS measured
    ~8 GFLOP/s at 1 thread and does not scale with threads, OpenBLAS
    40-250 per thread on the CPUs this project runs on).
During the timed steps it measures the threads that really ran as process CPU
time (user + sys, all threads: time.process_time) over wall time, reports it as
"threads_observed" and warns when it is below 0.75 x --threads (other load
on the machine, or a thread count that did not take). OpenBLAS's pthreads spin
a little while waiting for work, so the figure is an upper bound on useful
parallelism, not a lower one.

Where the step goes: after the timed steps, one more step runs under
torch's autograd profiler (the legacy one: Debian's torch has no kineto;
--profile-step off skips it). "gemm_ms" is the self CPU time of the GEMM ops
in it (GEMM_OPS: mm, addmm, bmm, baddbmm, addbmm, matmul, linear, mv, addmv,
dot; self time, so matmul's and linear's children are not counted twice, and
an op's wall time on the calling thread while OpenBLAS's threads work),
"other_ms" the rest of that step's wall time (every other op, Python, and the
profiler's own cost per op, small beside a step of seconds), "gemm_share" =
gemm_ms / "profile_step_ms", and "other_top" the non-GEMM ops with the most
self time ([name, ms] pairs). bench/compare_gpt2.sh prints them beside the
PyTorch row and flags a run whose non-GEMM share is far above a healthy one's.
"minor_faults_per_step" is the process's minor page faults per timed step
(getrusage): PyTorch's CPU allocator gives every tensor above glibc's mmap
threshold (32 MiB at most) fresh pages each step, so a step at V = 50257
touches the logits and their gradients (206 MB each at B*T = 1024) for the
first time every step, and what a page fault costs is up to the VM's host.
So the re-executed process (and every calibration probe of bench/torch_blas.py:
torch_blas.blas_env) runs with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (unless
the environment sets GLIBC_TUNABLES; glibc >= 2.35, older ones ignore it):
glibc then puts those mappings on transparent huge pages (the kernel's
THP mode "madvise" is enough) and takes one fault per 2 MiB instead of per 4
KiB. On the 2-vCPU Zen 5 VM of 2026-12-02 (GPT-2 124M, B=4, T=256, one
thread) that took PyTorch from 79 to 130 tokens/s: 478K page faults per step
down to 4.4K, and the share of the step outside the GEMMs from 53% to 35%
(the GEMMs too ran faster: their outputs were fresh pages as well). The JSON
line records "glibc_tunables".

bench/torch_llama_bench.py times the Llama of tools/llama_reference.py with
this file's driver (run_step_benchmark): the same setup, refusals, timing,
profile and JSON fields; only the model differs ("family" says which).

The JSON line also has "openblas_coretype" (the core used),
"openblas_coretype_gflops" (each candidate's GEMM GFLOP/s when it was chosen),
"openblas_coretype_source" (calibrated, cache or forced), "blas_library" (the
mapped libblas path), "blas_core" (what OpenBLAS says it runs),
"gemm_check_gflops" and "threads_observed".
"""

import argparse
import json
import resource
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_blas  # noqa: E402

CHILD_MARK = "LATTICE_TORCH_BENCH_CHILD"
SETUP_VAR = "LATTICE_TORCH_BENCH_SETUP"  # the parent's torch_blas.prepare() result, as JSON, for the child


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    torch_blas.add_step_benchmark_args(ap)
    add_driver_args(ap)
    args = ap.parse_args()
    torch_blas.check_step_benchmark_args(ap, args)
    return args


def add_driver_args(ap):
    """run_step_benchmark's own options (beside torch_blas.add_step_benchmark_args')."""
    ap.add_argument("--autocast", choices=["off", "bf16"], default="off",
                    help="run the forward and the loss under torch.autocast('cpu', dtype=torch.bfloat16) (mixed "
                         "precision: fp32 weights and optimizer, bf16 matmuls; bench/compare_precision.sh)")
    ap.add_argument("--profile-step", choices=["on", "off"], default="on",
                    help="run one more step after the timed ones under torch's profiler and report its GEMM and "
                         "non-GEMM time (gemm_ms, other_ms, gemm_share, other_top); default on")


def l2_bytes():
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            s = f.read().strip()
        mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1], 1)
        return int(s.rstrip("KM")) * mult
    except (OSError, ValueError):
        return None


# The ops that run a matrix product (BLAS); their self CPU time is the step's GEMM time.
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
                      "aten::linear", "aten::mv", "aten::addmv", "aten::dot"})


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profile_step(torch, step, top=6):
    """Runs step() once under the autograd profiler: where its wall time went (the docstring's fields)."""
    with torch.autograd.profiler.profile() as prof:
        t0 = time.perf_counter()
        step()
        wall_ms = (time.perf_counter() - t0) * 1e3
    self_ms = {}
    for e in prof.function_events:  # self time: each microsecond counted in one op only
        self_ms[e.name] = self_ms.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    gemm_ms = sum(ms for name, ms in self_ms.items() if name in GEMM_OPS)
    others = sorted(((name, ms) for name, ms in self_ms.items() if name not in GEMM_OPS), key=lambda kv: -kv[1])
    return {"profile_step_ms": wall_ms, "gemm_ms": gemm_ms, "other_ms": wall_ms - gemm_ms,
            "gemm_share": gemm_ms / wall_ms,
            "other_top": [[name, round(ms, 1)] for name, ms in others[:top]]}


def fail(msg):
    print(f"{os.path.basename(sys.argv[0])}: {msg}", file=sys.stderr)
    sys.exit(1)


def reexec_with_blas_env(args):
    """Set up OpenBLAS, then re-exec with its env vars: they must be set before `import torch` loads it."""
    if os.environ.get(CHILD_MARK) == "1":
        return json.loads(os.environ[SETUP_VAR])
    try:
        setup = torch_blas.prepare(args.threads, args.coretype, args.recalibrate)
    except torch_blas.SetupError as e:
        fail(str(e))
    env = torch_blas.blas_env(setup["openblas_coretype"], args.threads)
    env[CHILD_MARK] = "1"
    env[SETUP_VAR] = json.dumps({k: setup[k] for k in ("openblas_coretype", "openblas_coretype_gflops",
                                                       "openblas_coretype_source", "openblas_auto_core", "cpu")})
    tuned_env(env)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def tuned_env(env):
    """The environment the docstring gives a PyTorch process besides torch_blas.blas_env's (OpenBLAS's
    core type and threads, glibc's huge pages): passive OpenMP waiting and this CPU's L2 size. A
    value the caller's environment already sets is kept (but OPENBLAS_L2_SIZE)."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # two spinning thread pools
    l2 = l2_bytes()
    if l2:
        env["OPENBLAS_L2_SIZE"] = str(l2)
    return env


def check_blas(torch, args, setup):
    """The refusals of the docstring; returns the BLAS facts and the GEMM rate for the JSON line."""
    try:
        got = torch_blas.check_loaded_blas(torch, args.threads, setup["openblas_coretype"])
    except torch_blas.SetupError as e:
        fail(str(e))
    m, k, n = torch_blas.GEMM_SHAPES[0]
    rate = torch_blas.gemm_rate(torch, m, k, n, reps=3)
    floor = args.min_gemm_gflops_per_thread * args.threads
    if rate < floor:
        fail(f"torch.matmul {m}x{k}x{n} ran at {rate:.1f} GFLOP/s on {args.threads} thread(s) with "
             f"{got['blas_library']} ({got['blas_config']}, core {got['blas_core']}), below the "
             f"--min-gemm-gflops-per-thread {args.min_gemm_gflops_per_thread:g} x {args.threads} = {floor:g} "
             "that any usable OpenBLAS reaches; not a fair reference, no result printed")
    return {"blas": got["blas_config"], "blas_core": got["blas_core"], "blas_threads": got["openblas_threads"],
            "blas_library": got["blas_library"], "gemm_check_gflops": rate}


def flops_per_token(n_params, n_layer, n_embd, seq):
    """Model FLOPs per trained token, 6N + 12·L·C·T (the docstring; lattice's ModelConfig::flops_per_token).
    n_params: the parameters that are multiplied (not the lookup-only tables), a tied embedding once."""
    return 6 * n_params + 12 * n_layer * n_embd * seq


class StepModel:
    """What run_step_benchmark needs of a model: the module, its loss, the weight-decay rule, the
    parameter count for flops_per_token and the JSON fields that describe it ("family", shapes)."""

    def __init__(self, model, forward_loss, is_decayed, flops_params, fields):
        self.model, self.forward_loss, self.is_decayed = model, forward_loss, is_decayed
        self.flops_params, self.fields = flops_params, fields


def run_step_benchmark(args, build):
    """The benchmark of the docstring for the model build(torch, args) returns (a StepModel):
    OpenBLAS set up and the process re-executed with its environment, the BLAS checked, warm-up
    and timed steps, one profiled step, one JSON line on stdout."""
    setup = reexec_with_blas_env(args)

    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

    info = check_blas(torch, args, setup)

    built = build(torch, args)
    model = built.model
    decay = [p for n, p in model.named_parameters() if built.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not built.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, foreach=(args.foreach == "on"))

    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def train_step():
        opt.zero_grad(set_to_none=True)
        if args.autocast == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = built.forward_loss(model, x, y)
        else:
            loss = built.forward_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss

    times, losses = [], []
    cpu0 = wall0 = faults0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # process CPU time = user + sys of all threads (ns resolution, unlike os.times)
            cpu0, wall0, faults0 = time.process_time(), time.perf_counter(), minor_faults()
        t0 = time.perf_counter()
        loss = train_step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(dt)
    threads_observed = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    faults_per_step = (minor_faults() - faults0) / args.steps
    # One more step, untimed, under the profiler (its cost per op would otherwise enter step_ms).
    breakdown = profile_step(torch, train_step) if args.profile_step == "on" else {}
    if threads_observed < 0.75 * args.threads:
        print(f"{os.path.basename(sys.argv[0])}: warning: asked for {args.threads} threads, {threads_observed:.2f} "
              "ran on average during the timed steps (CPU time / wall time): other load on the machine, or steps "
              "too small to spread over the threads?", file=sys.stderr)

    fpt = flops_per_token(built.flops_params, built.fields["n_layer"], built.fields["n_embd"], args.seq)
    step_s = statistics.mean(times)
    tokens_per_sec = args.batch * args.seq / step_s
    out = {
        "impl": "pytorch",
        "tokens_per_sec": tokens_per_sec,
        "step_ms": step_s * 1e3,
        "model_flops_per_sec": fpt * tokens_per_sec,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tokens_per_sec_best": args.batch * args.seq / min(times),  # fastest step: least disturbed by other load
        "flops_per_token": fpt,
        "n_params": built.flops_params,
        **built.fields,
        "batch": args.batch, "seq": args.seq, "threads": args.threads,
        "steps": args.steps, "warmup": args.warmup,
        "loss_first": losses[0], "loss_last": losses[-1],
        "compute": "bf16-autocast" if args.autocast == "bf16" else "f32",
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "adamw_foreach": args.foreach == "on",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "threads_observed": threads_observed,
        "minor_faults_per_step": faults_per_step,
        **breakdown,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "cpu": setup["cpu"],
        "openblas_coretype": setup["openblas_coretype"],
        "openblas_coretype_gflops": setup["openblas_coretype_gflops"],
        "openblas_coretype_source": setup["openblas_coretype_source"],
        "openblas_auto_core": setup["openblas_auto_core"],
        "openblas_l2_size_env": os.environ.get("OPENBLAS_L2_SIZE"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        **info,
    }
    print(json.dumps(out))


def build_gpt2(torch, args):
    """tools/gpt2_reference.py's GPT-2; N leaves out the position embedding (a lookup)."""
    import gpt2_reference as ref
    cfg = ref.GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         vocab_size=args.vocab, n_positions=args.seq)
    model = ref.build_model(cfg)
    ref.init_params(model, seed=args.seed)
    n_params = ref.count_params(model) - model.wpe.weight.numel()
    return StepModel(model, ref.forward_loss, ref.is_decayed, n_params,
                     {"family": "gpt2", "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                      "vocab_size": args.vocab})


def main():
    run_step_benchmark(parse_args(), build_gpt2)


if __name__ == "__main__":
    main()
