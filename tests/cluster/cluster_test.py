#!/usr/bin/env python3
"""lattice on an emulated two-node cluster (scripts/cluster.sh): real TCP
between the nodes over shaped links, shared memory inside a node.

Brings up its own cluster (namespaces lattice-t<pid>-*, a state directory of
its own) and always takes it down again, then checks:

  equivalence  2 nodes x 2 ranks, dp2 x tp2 with TP inside the nodes, trains
               the tiny model to the same per-step losses as one process with
               the same global batch (relative 1e-5), and the data-parallel
               all-reduce really crossed the link (the link's byte counters)
  placement    the run header names each TP group's node; with tp = 2 forced
               across 2 nodes x 1 rank it warns that the group spans nodes
  slow link    the link drops to a tenth of its rate mid-run: the steps slow
               down, the run completes with the same losses, bit for bit
  node killed  every rank of node1 killed mid-run: mpirun exits non-zero
               within 60 s; the last checkpoint written before resumes (2
               ranks on one machine) to the uninterrupted run's losses and
               final weights, bit for bit
  link cut     node1's link cut mid-run: mpirun exits non-zero within 60 s
               with the watchdog's message naming the collective and the rank;
               node1's ranks end too

Exit status: 0 all passed, 1 a check failed, 77 skipped (not root, no network
namespaces, ...; the reason is printed). Keep it under ~2 minutes.

  cluster_test.py --lattice build/lattice --cluster-script scripts/cluster.sh
                  [--config configs/tiny.toml] [--keep-dir]
"""
import argparse
import json
import re
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_head=4", "--set", "model.n_embd=32",
    "--set", "model.vocab_size=101", "--set", "model.seq_len=16", "--set", "train.threads=1",
    "--set", "train.micro_batch_size=4",
]
CUT_TIMEOUT_S = 60  # the most a job may take to end after a fault
WATCHDOG_S = 10      # LATTICE_COMM_TIMEOUT_S of the runs that are cut


class Failed(Exception):
    pass


def log(msg):
    print(msg, flush=True)


class Cluster:
    """The test's own cluster, through scripts/cluster.sh (main takes it down on any exit)."""

    # Private /24s to try, in order, when this machine already uses one.
    SUBNETS = ("10.77.0", "172.31.77", "192.168.177")

    def __init__(self, script, name, state_dir):
        self.script, self.name, self.dir = script, name, state_dir
        self.net = self.SUBNETS[0]

    def run(self, *args, check=True):
        p = subprocess.run([self.script, *args, "--name", self.name, "--dir", self.dir],
                           capture_output=True, text=True)
        if check and p.returncode != 0:
            raise Failed(f"cluster.sh {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def up(self, rate):
        return self.run("up", "--nodes", "2", "--slots", "2", "--rate", rate, "--subnet", f"{self.net}.0/24",
                        check=False)

    def first_up(self, rate):
        for net in self.SUBNETS:
            self.net = net
            p = self.up(rate)
            if not (p.returncode == 77 and "is in use on this machine" in p.stderr):
                break
        return p

    def addr(self, node):
        return f"{self.net}.{node + 1}"

    def down(self):
        self.run("down", check=False)

    def shape(self, rate):
        self.run("shape", "--rate", rate)

    def link(self, node, state):
        self.run("link", str(node), state)

    def namespace(self, node):
        return f"{self.name}-node{node}"

    def tx_bytes(self, node):
        out = subprocess.run(["ip", "-n", self.namespace(node), "-j", "-s", "link", "show", "dev", "eth0"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]

    def pids(self, node):
        out = subprocess.run(["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def lattice_pids(self, node):
        found = []
        for pid in self.pids(node):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "lattice":
                        found.append(pid)
            except OSError:
                pass
        return found

    def mpirun(self, n, args, extra=(), env=None, **popen):
        # The jobs run niced, and their waiting ranks yield the core: on a
        # machine with fewer cores than ranks, busy-polling ranks would
        # otherwise delay the test's own actions (a reshape, a cut) by seconds.
        env = dict(env if env is not None else os.environ, OMPI_MCA_mpi_yield_when_idle="1")
        cmd = ["nice", "-n", "10", os.path.join(self.dir, "mpirun"), "-n", str(n), *extra, *args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, **popen)


def losses(metrics_path):
    with open(metrics_path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def step_ms(metrics_path):
    with open(metrics_path) as f:
        return {r["step"]: r["step_ms"] for r in map(json.loads, f) if "step_ms" in r}


def metrics_steps(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def finish(proc, timeout, what):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise Failed(f"{what}: still running after {timeout} s; output:\n{out[-3000:]}")
    return proc.returncode, out


def run_ok(proc, what, timeout=120):
    rc, out = finish(proc, timeout, what)
    if rc != 0:
        raise Failed(f"{what}: exited {rc}; output:\n{out[-3000:]}")
    return out


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise Failed(f"timed out after {timeout} s waiting for {what}")


def header_lines(out):
    return [line[len("lattice: "):] for line in out.splitlines() if line.startswith("lattice: ")]


# ---- the checks ---------------------------------------------------------------

def check_refusals(a, c, work):
    """cluster.sh refuses clearly, and leaves nothing behind when it does."""
    def expect(args, rc, text, as_user=False):
        cmd = [c.script, *args, "--name", c.name, "--dir", c.dir]
        if as_user:
            cmd = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != rc or text not in p.stderr:
            raise Failed(f"{' '.join(args)}: exit {p.returncode} (want {rc}), stderr {p.stderr.strip()!r} "
                         f"(want it to say {text!r})")
        if c.name + "-" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            raise Failed(f"{' '.join(args)} left namespaces behind")
    expect(["up", "--rate", "fast"], 2, "--rate 'fast' is invalid")
    expect(["up", "--nodes", "0"], 2, "--nodes '0' is invalid: 1 to 64")
    expect(["up", "--subnet", "127.0.0.0/24"], 77, "subnet 127.0.0.0/24 is in use on this machine")
    expect(["shape", "--rate", "1gbit"], 1, "no cluster")
    if shutil.which("setpriv"):
        # The unprivileged user runs a copy the user can read: the checkout may
        # lie in a directory only root can enter (a fresh clone under mktemp -d).
        copy_dir = tempfile.mkdtemp(prefix="lattice-cluster-user-")
        try:
            os.chmod(copy_dir, 0o755)
            copy = os.path.join(copy_dir, "cluster.sh")
            shutil.copy(c.script, copy)
            os.chmod(copy, 0o755)
            script, c.script = c.script, copy
            try:
                expect(["up"], 77, "it needs root", as_user=True)
            finally:
                c.script = script
        finally:
            shutil.rmtree(copy_dir, ignore_errors=True)
    # A delay needs netem: refused (nothing left behind) where the kernel lacks it.
    p = subprocess.run([c.script, "up", "--delay", "1ms", "--subnet", f"{c.net}.0/24", "--name", c.name, "--dir", c.dir],
                       capture_output=True, text=True)
    if p.returncode == 77:
        if "no netem qdisc" not in p.stderr:
            raise Failed(f"up --delay 1ms: exit 77 without saying why netem is missing: {p.stderr.strip()!r}")
        netem = "no netem on this kernel: --delay refused"
    elif p.returncode == 0:
        c.down()
        netem = "netem present: --delay 1ms accepted"
    else:
        raise Failed(f"up --delay 1ms: exit {p.returncode}: {p.stderr.strip()}")
    if c.name + "-" in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        raise Failed("up --delay 1ms left namespaces behind")
    return netem


def check_lifecycle(a, c, work):
    """up twice is fine; status shows the nodes; the files Open MPI needs are there."""
    p = c.up("1gbit")
    if p.returncode != 0 or "already up" not in p.stdout:
        raise Failed(f"a second up: exit {p.returncode}, {p.stdout.strip()!r} {p.stderr.strip()!r}")
    st = c.run("status").stdout
    for node in (f"node0  {c.addr(0)}  link UP  tbf 1Gbit", f"node1  {c.addr(1)}  link UP  tbf 1Gbit"):
        if node not in st:
            raise Failed(f"status lacks {node!r}:\n{st}")
    with open(os.path.join(c.dir, "hostfile")) as f:
        if f.read() != "node0 slots=2\nnode1 slots=2\n":
            raise Failed("the hostfile is not 'node0 slots=2', 'node1 slots=2'")
    out = subprocess.run([os.path.join(c.dir, "on"), "node1", "sh", "-c", "hostname; getent hosts node0"],
                         capture_output=True, text=True).stdout.split()
    if out[:2] != ["node1", c.addr(0)]:
        raise Failed(f"on node1: hostname and node0's address are {out[:2]}, want ['node1', '{c.addr(0)}']")
    return "up again kept the cluster; node1 is 'node1' and resolves node0"

def check_equivalence(a, c, work):
    """dp2 x tp2 over 2 nodes x 2 ranks == one process, same global batch."""
    one = os.path.join(work, "one.jsonl")
    four = os.path.join(work, "dp2tp2.jsonl")
    common = [a.lattice, "train", "-c", a.config, *TINY, "--set", "train.steps=5"]
    p = subprocess.run(common + ["--set", "train.micro_batch_size=8", "--set", f"log.metrics_file={one}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise Failed(f"the one-process run exited {p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    before = c.tx_bytes(0)
    out = run_ok(c.mpirun(4, common + ["--set", "parallel.dp=2", "--set", "parallel.tp=2",
                                       "--set", f"log.metrics_file={four}"]), "dp2 x tp2 on 2 nodes x 2 ranks")
    sent = c.tx_bytes(0) - before
    ref, got = losses(one), losses(four)
    if sorted(ref) != list(range(1, 6)) or sorted(got) != sorted(ref):
        raise Failed(f"steps differ: one process {sorted(ref)}, cluster {sorted(got)}")
    for s in ref:
        rel = abs(got[s] - ref[s]) / abs(ref[s])
        if rel > 1e-5:
            raise Failed(f"step {s}: loss {got[s]!r} on the cluster vs {ref[s]!r} in one process (relative {rel:.2e})")
    # The data-parallel all-reduce of ~29K f32 gradients per step crossed the
    # link: 5 steps send well over 5 x 29K x 4 / 2 bytes each way.
    params = 29_184
    if sent < 5 * params * 4 // 2:
        raise Failed(f"node0 sent only {sent} bytes over its link during 5 steps of dp=2 across the nodes")
    head = header_lines(out)
    want = ["nodes: 2 (node0: ranks 0-1; node1: ranks 2-3)",
            "tensor-parallel groups: ranks 0,1 on node0, ranks 2,3 on node1 (each inside one node)"]
    for w in want:
        if w not in head:
            raise Failed(f"the header lacks '{w}':\n" + "\n".join(head))
    if any(h.startswith("warning: tensor-parallel") for h in head):
        raise Failed("the header warns about a TP group although each is inside a node:\n" + "\n".join(head))
    return f"5 losses within 1e-5 of one process (max relative {max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref):.1e}), " \
           f"node0 sent {sent / 1e6:.2f} MB over its link"


def check_placement_warning(a, c, work):
    """tp = 2 across 2 nodes x 1 rank is warned about."""
    out = run_ok(c.mpirun(2, [a.lattice, "train", "-c", a.config, *TINY, "--set", "train.steps=1",
                              "--set", "parallel.tp=2"], extra=["--map-by", "node"]), "tp=2 on 2 nodes x 1 rank")
    head = header_lines(out)
    want = ["nodes: 2 (node0: rank 0; node1: rank 1)",
            "tensor-parallel groups: ranks 0,1 on node0 and node1",
            "warning: tensor-parallel group of ranks 0,1 spans nodes node0 and node1: every layer's all-reduces "
            "cross the link; make parallel.tp divide the ranks per node"]
    for w in want:
        if w not in head:
            raise Failed(f"the header lacks '{w}':\n" + "\n".join(head))
    return "the warning names ranks 0,1 and both nodes"


def dp2_run(a, c, work, name, steps, extra_sets=(), env=None):
    metrics = os.path.join(work, f"{name}.jsonl")
    args = [a.lattice, "train", "-c", a.config, *TINY, "--set", f"train.steps={steps}", "--set", "parallel.dp=2",
            "--set", f"log.metrics_file={metrics}", "--set", "log.every=10", *extra_sets]
    extra = ["--map-by", "node"]
    if env and "LATTICE_COMM_TIMEOUT_S" in env:
        extra += ["-x", "LATTICE_COMM_TIMEOUT_S"]  # as on a real cluster, where ssh does not pass it on
    return c.mpirun(2, args, extra=extra, env=env), metrics


STEPS = 80  # at 100mbit a step takes ~11 ms, at 10mbit ~100 ms


def check_slow_link(a, c, work, ref_dir):
    """100mbit -> 10mbit after step 5: slower steps, the same run."""
    c.shape("100mbit")
    proc, ref_metrics = dp2_run(a, c, work, "reference", STEPS,
                                ["--set", f"checkpoint.dir={ref_dir}", "--set", "checkpoint.keep=1"])
    run_ok(proc, "the uninterrupted reference run")
    proc, metrics = dp2_run(a, c, work, "slowed", STEPS)
    wait_for(lambda: metrics_steps(metrics) >= 5 or proc.poll() is not None, 60, "step 5 of the slowed run")
    c.shape("10mbit")
    changed_after = metrics_steps(metrics)
    run_ok(proc, "the run whose link dropped to a tenth")
    c.shape("100mbit")
    ref, got = losses(ref_metrics), losses(metrics)
    if got != ref:
        bad = [s for s in ref if got.get(s) != ref[s]][:3]
        raise Failed(f"losses differ from the uninterrupted run at steps {bad}")
    ms = step_ms(metrics)
    before = statistics.median(ms[s] for s in range(2, 6))
    if changed_after + 10 > STEPS:
        raise Failed(f"the run reached step {changed_after} of {STEPS} before the link was reshaped")
    after = statistics.median(ms[s] for s in range(changed_after + 3, STEPS + 1))
    if after < 3 * before:
        raise Failed(f"median step {before:.1f} ms at 100mbit vs {after:.1f} ms at 10mbit: the shaping did not bite")
    return f"median step {before:.1f} ms at 100mbit, {after:.1f} ms at 10mbit; {STEPS} losses identical"


def check_node_killed(a, c, work, ref_dir):
    """Every rank of node1 killed after the checkpoint of step 20; resume it."""
    c.shape("10mbit")
    ck = os.path.join(work, "ck-killed")
    proc, metrics = dp2_run(a, c, work, "killed", STEPS,
                            ["--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=10"])
    wait_for(lambda: os.path.exists(os.path.join(ck, "step_000020", "meta.json")) or proc.poll() is not None,
             60, "the checkpoint of step 20")
    victims = c.lattice_pids(1)
    if proc.poll() is not None or not victims:
        raise Failed(f"the run ended before node1 could be killed (rc {proc.poll()}, ranks on node1 {victims})")
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rc, out = finish(proc, CUT_TIMEOUT_S + 30, "the job whose node1 was killed")
    took = time.monotonic() - killed_at
    c.shape("100mbit")
    if rc == 0 or took > CUT_TIMEOUT_S:
        raise Failed(f"after node1's ranks were killed mpirun exited {rc} in {took:.1f} s; output:\n{out[-2000:]}")
    done = metrics_steps(metrics)
    if done >= STEPS:
        raise Failed(f"the killed run finished all {STEPS} steps")
    wait_for(lambda: not c.pids(0) and not c.pids(1), 30, "the cluster's processes to end after the kill")
    # Resume the last checkpoint written before the fault: two ranks on one
    # machine (no cluster), the same layout, to the end.
    resumed = os.path.join(work, "resumed.jsonl")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", a.lattice, "train", "-c", a.config, *TINY,
                        "--set", f"train.steps={STEPS}", "--set", "parallel.dp=2", "--set", f"checkpoint.dir={ck}",
                        "--set", "checkpoint.resume=latest", "--set", f"log.metrics_file={resumed}"],
                       capture_output=True, text=True, env=env, timeout=120)
    if p.returncode != 0:
        raise Failed(f"the resume exited {p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    ref, got = losses(os.path.join(work, "reference.jsonl")), losses(resumed)
    first = min(got)
    if first > 21 or max(got) != STEPS:
        raise Failed(f"the resume ran steps {first}..{max(got)}, expected from at most 21 to {STEPS}")
    bad = [s for s in got if got[s] != ref[s]]
    if bad:
        raise Failed(f"resumed losses differ from the uninterrupted run at steps {bad[:3]}: "
                     f"{got[bad[0]]!r} vs {ref[bad[0]]!r}")
    final = f"step_{STEPS:06d}"
    with open(os.path.join(ck, final, "model.safetensors"), "rb") as f1, \
            open(os.path.join(ref_dir, final, "model.safetensors"), "rb") as f2:
        if f1.read() != f2.read():
            raise Failed(f"{final}/model.safetensors differs between the resumed and the uninterrupted run")
    return f"mpirun exited {rc} {took:.1f} s after the kill (at step {done}); resumed from step {first - 1}: " \
           f"losses {first}..{STEPS} and the final weights bit-identical"


def check_link_cut(a, c, work):
    """node1's link cut mid-run: the job ends within 60 s, naming the collective and the rank."""
    c.shape("1gbit")
    env = dict(os.environ, LATTICE_COMM_TIMEOUT_S=str(WATCHDOG_S))
    proc, metrics = dp2_run(a, c, work, "cut", 10_000_000, env=env)
    wait_for(lambda: metrics_steps(metrics) >= 50 or proc.poll() is not None, 60, "50 steps of the run to cut")
    if proc.poll() is not None:
        raise Failed(f"the run to cut ended by itself (rc {proc.returncode})")
    c.link(1, "down")
    cut_at = time.monotonic()
    try:
        rc, out = finish(proc, CUT_TIMEOUT_S + 60, "the job whose link was cut")
        took = time.monotonic() - cut_at
        if rc == 0 or took > CUT_TIMEOUT_S:
            raise Failed(f"after node1's link was cut mpirun exited {rc} in {took:.1f} s; output:\n{out[-2000:]}")
        # The ranks behind the cut end too (their own watchdog), link still down.
        wait_for(lambda: not c.lattice_pids(1), max(1.0, CUT_TIMEOUT_S - took), "node1's ranks to end")
        gone = time.monotonic() - cut_at
    finally:
        c.link(1, "up")
    # Whichever collective the cut caught (the gradient all-reduce, the loss
    # all-gather, the stop flag's all-reduce...), named with the silent peer.
    named = [line for line in out.splitlines()
             if re.search(r"watchdog: (all_reduce|reduce_scatter|all_gather|broadcast|all_to_all|send|recv|"
                          r"barrier)\b.*\brank 1\b", line) or "lost communication" in line]
    if not named:
        raise Failed(f"no message names the collective and the peer; output:\n{out[-2000:]}")
    return f"mpirun exited {rc} {took:.1f} s after the cut, node1's ranks were gone by {gone:.1f} s: " \
           f"{named[0].strip()[:150]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lattice", required=True)
    ap.add_argument("--cluster-script", required=True)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.toml"))
    ap.add_argument("--keep-dir", action="store_true", help="keep the work directory (metrics, checkpoints)")
    ap.add_argument("--only", default="", help="comma-separated checks to run (default: all)")
    a = ap.parse_args()
    a.lattice = os.path.abspath(a.lattice)
    a.config = os.path.abspath(a.config)

    if os.geteuid() != 0:
        print("SKIP: the emulated cluster needs root (network namespaces, veth, tc)", flush=True)
        return 77
    for tool in ("ip", "tc", "mpirun"):
        if shutil.which(tool) is None:
            print(f"SKIP: '{tool}' is not installed", flush=True)
            return 77

    work = tempfile.mkdtemp(prefix="lattice-cluster-test-")
    c = Cluster(os.path.abspath(a.cluster_script), f"lattice-t{os.getpid()}", os.path.join(work, "cluster"))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    passed = failed = 0
    try:
        p = c.first_up("1gbit")
        if p.returncode == 77:
            print(f"SKIP: {p.stderr.strip()}", flush=True)
            return 77
        if p.returncode != 0:
            print(f"FAIL: cluster.sh up exited {p.returncode}: {p.stderr.strip()}", flush=True)
            return 1
        log(f"cluster {c.name} up in {c.dir}")
        ref_dir = os.path.join(work, "ck-reference")
        # The refusals use a cluster name of their own: nothing they do may
        # touch the one that is up.
        refused = Cluster(c.script, c.name + "r", os.path.join(work, "refused"))
        refused.net = c.net
        checks = [
            ("refusals", lambda: check_refusals(a, refused, work)),
            ("lifecycle", lambda: check_lifecycle(a, c, work)),
            ("equivalence", lambda: check_equivalence(a, c, work)),
            ("placement", lambda: check_placement_warning(a, c, work)),
            ("slow_link", lambda: check_slow_link(a, c, work, ref_dir)),
            ("node_killed", lambda: check_node_killed(a, c, work, ref_dir)),
            ("link_cut", lambda: check_link_cut(a, c, work)),
        ]
        only = [x for x in a.only.split(",") if x]
        for name, fn in checks:
            if only and name not in only:
                continue
            t0 = time.monotonic()
            try:
                detail = fn()
                passed += 1
                log(f"PASS {name} ({time.monotonic() - t0:.1f} s): {detail}")
            except Exception as e:  # noqa: BLE001 - any error fails this check, the others still run
                failed += 1
                kind = "" if isinstance(e, Failed) else f"{type(e).__name__}: "
                log(f"FAIL {name} ({time.monotonic() - t0:.1f} s): {kind}{e}")
    finally:
        c.down()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if c.name + "-" in left:
            log(f"FAIL: namespaces of {c.name} are left after down:\n{left}")
            failed += 1
        if os.path.exists(c.dir) or any(d.startswith(c.name + "-") for d in
                                        (os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else [])):
            log(f"FAIL: down left {c.dir} or /etc/netns/{c.name}-* behind")
            failed += 1
        if a.keep_dir:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
