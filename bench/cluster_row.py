#!/usr/bin/python3
"""One row of bench/cluster_bench.sh: runs a job on the emulated cluster, counts
the bytes its nodes sent over their links, and prints one JSON line.

    bench/cluster_row.py --row NAME --log FILE [--switch NS --nodes N]
                         [--steps-file FILE --warmup W] [--parse comm|json]
                         [--timeout S] [--meta JSON] -- CMD... [-- CMD...]

Every CMD is started at once, each in a process group of its own (a job whose
ranks are started one per node, like PyTorch DDP's, is several CMDs; an mpirun
job is one). The row succeeds when every CMD exits 0 within --timeout seconds;
otherwise the others are stopped (SIGTERM, then SIGKILL after 5 s) and the JSON
says why. Every CMD's stdout and stderr go to --log; the result is read from
the first CMD's stdout.

Link bytes. With --switch, a sampler inside the switch namespace of
scripts/cluster.sh reads /proc/net/dev every 50 ms: port I's received bytes are
what node I sent into its link. With --steps-file (a JSONL file the job appends
one line to per step: lattice's log.metrics_file, torch_ddp_bench.py's
--steps-file), the counters are read when each line appears, and the bytes of
the timed steps (those after the first --warmup) are divided by their number:
link_bytes_per_step, the wire's figure (TCP/IP headers and every message of the
job included). Without a steps file, link_bytes_total covers the whole run,
start-up included.

--parse json: the first CMD's last stdout line that is a JSON object is merged
into the result (torch_ddp_bench.py). --parse comm: the first CMD's stdout is
`lattice bench comm`'s table, turned into {"comm": {op: [{bytes, lattice_us,
lattice_busbw, raw_us, raw_busbw}, ...]}}. With a steps file that is lattice's
metrics file, the timed steps are summarised (see summarise_metrics).
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

PROG = "cluster_row.py"

# Runs inside the switch namespace: "seconds rx0 tx0 rx1 tx1 ..." every 50 ms, ports in order.
SAMPLER = r"""
import sys, time
n = int(sys.argv[1])
while True:
    rx, tx = {}, {}
    for line in open("/proc/net/dev").readlines()[2:]:
        name, rest = line.split(":", 1)
        f = rest.split()
        rx[name.strip()], tx[name.strip()] = int(f[0]), int(f[8])
    print(time.monotonic(), *[x for i in range(n) for x in (rx.get(f"port{i}", -1), tx.get(f"port{i}", -1))],
          flush=True)
    time.sleep(0.05)
"""


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", required=True, help="the row's name (copied into the JSON)")
    ap.add_argument("--log", required=True, help="file for every command's stdout and stderr")
    ap.add_argument("--switch", help="the cluster's switch namespace (NAME-switch): count the link bytes")
    ap.add_argument("--nodes", type=int, default=2, help="nodes of the cluster (default 2)")
    ap.add_argument("--steps-file", help="JSONL file the job appends one line to per step")
    ap.add_argument("--warmup", type=int, default=0, help="steps not timed, at the start (default 0)")
    ap.add_argument("--parse", choices=("none", "json", "comm"), default="none")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before every command is stopped")
    ap.add_argument("--meta", default="{}", help="a JSON object merged into the result (the row's settings)")
    ap.add_argument("cmds", nargs=argparse.REMAINDER, help="-- CMD... [-- CMD...]")
    args = ap.parse_args()
    cmds, cur = [], None
    for word in args.cmds:
        if word == "--":
            cur = []
            cmds.append(cur)
        elif cur is None:
            ap.error(f"commands start after '--' (got '{word}')")
        else:
            cur.append(word)
    args.cmds = [c for c in cmds if c]
    if not args.cmds:
        ap.error("no command given (-- CMD...)")
    try:
        args.meta = json.loads(args.meta)
    except json.JSONDecodeError as e:
        ap.error(f"--meta is not a JSON object: {e}")
    return args


class Sampler:
    """The link counters, read continuously in the switch namespace."""

    def __init__(self, switch, nodes):
        self.nodes, self.latest, self.error = nodes, None, None
        self.proc = subprocess.Popen(["ip", "netns", "exec", switch, sys.executable, "-c", SAMPLER, str(nodes)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(10):
            self.stop()
            raise RuntimeError(f"no link counters from namespace {switch}: {self.error or 'the sampler is silent'}")

    def _read(self):
        for line in self.proc.stdout:
            f = line.split()
            values = [int(x) for x in f[1:]]
            if any(v < 0 for v in values):
                self.error = f"a port of port0..port{self.nodes - 1} is missing in the switch namespace"
                break
            self.latest = values
            self.ready.set()
        if self.error is None:
            self.error = (self.proc.stderr.read() or "").strip().splitlines()[-1:] or None

    def sent(self):
        """Bytes each node has sent into its link so far (its switch port's received bytes)."""
        v = self.latest
        return [v[2 * i] for i in range(self.nodes)]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait()


def stop_group(p):
    """SIGTERM a command's process group, SIGKILL it after 5 s."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    except ProcessLookupError:
        pass


def read_jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line being written
    except OSError:
        pass
    return rows


def count_lines(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def summarise_metrics(rows, warmup):
    """lattice's metrics lines (rank 0's) of the timed steps: means of the per-step figures, the
    largest peak memory, tokens/s of the whole job from the mean step time."""
    timed = [r for r in rows if r.get("step", 0) > warmup]
    if not timed:
        return {}
    out = {"steps_timed": len(timed)}
    ms = [r["step_ms"] for r in timed]
    out.update(step_ms=statistics.mean(ms), step_ms_median=statistics.median(ms), step_ms_min=min(ms))
    if all("tokens" in r for r in rows) and len(rows) >= 2:
        tokens_per_step = rows[-1]["tokens"] / rows[-1]["step"]
        out["tokens_per_step"] = tokens_per_step
        out["tokens_per_sec"] = tokens_per_step / (out["step_ms"] / 1e3)
    for key in ("comm_ms", "comm_exposed_ms", "comm_hidden", "comm_bytes", "grad_bytes", "grad_bytes_uncompressed",
                "tp_comm_ms", "tp_comm_bytes", "pp_comm_bytes", "pp_bubble", "pp_bubble_simulated"):
        if all(key in r for r in timed):
            out[key] = statistics.mean(r[key] for r in timed)
    if any("peak_mem_bytes" in r for r in rows):
        out["peak_mem_bytes"] = max(r.get("peak_mem_bytes", 0) for r in rows)
    out["loss_last"] = timed[-1].get("loss")
    return out


COMM_OP = re.compile(r"^# (\w+) \(busbw factor")
COMM_ROW = re.compile(r"^\s*([\d.]+) (B|KiB|MiB|GiB)\s+\d+\s+\d+ \|\s*([\d.]+)\s+[\d.]+\s+([\d.]+) \|\s*([\d.]+)\s+[\d.]+"
                      r"\s+([\d.]+) \|")
UNIT = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def parse_comm(text):
    """`lattice bench comm`'s table: per operation, per size, lattice's and raw MPI's time and busbw."""
    ops, op = {}, None
    for line in text.splitlines():
        m = COMM_OP.match(line)
        if m:
            op = m.group(1)
            ops[op] = []
            continue
        m = COMM_ROW.match(line)
        if m and op:
            ops[op].append({"bytes": int(float(m.group(1)) * UNIT[m.group(2)]), "lattice_us": float(m.group(3)),
                            "lattice_busbw": float(m.group(4)), "raw_us": float(m.group(5)),
                            "raw_busbw": float(m.group(6))})
    return ops


def last_error_line(log_path):
    """The job's own error line: lattice's first "rank N: message", else a Python exception or
    torch_ddp_bench.py's message, else the last line that looks like an error, else the last line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
    except OSError:
        return ""
    for pattern in (r"^rank \d+: ", r"^torch_ddp_bench\.py( rank \d+)?: (?!warning)", r"^[A-Za-z_.]*(Error|Exception): "):
        for l in lines:
            if re.match(pattern, l):
                return l.strip()[:400]
    for l in reversed(lines):
        if re.search(r"error|fail|abort|refus|invalid|cannot|killed|timed out", l, re.I) and not l.startswith("{"):
            return l.strip()[:400]
    return lines[-1].strip()[:400] if lines else ""


def main():
    args = parse_args()
    result = {"row": args.row, **args.meta, "cmd": [" ".join(c) for c in args.cmds], "log": args.log,
              "load1_start": os.getloadavg()[0]}
    sampler = None
    if args.switch:
        try:
            sampler = Sampler(args.switch, args.nodes)
        except RuntimeError as e:
            print(json.dumps(dict(result, ok=False, error=str(e))), flush=True)
            return 1
    if args.steps_file and os.path.exists(args.steps_file):
        os.unlink(args.steps_file)
    log = open(args.log, "a")
    outs = [open(args.log + f".stdout{i}", "w+") for i in range(len(args.cmds))]
    marks = {}  # steps written -> each node's sent bytes when that many lines had appeared
    start_sent = sampler.sent() if sampler else None
    t0 = time.monotonic()
    procs, rc, why = [], 0, None
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    try:
        for i, cmd in enumerate(args.cmds):
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            procs.append(subprocess.Popen(cmd, stdout=outs[i], stderr=log, start_new_session=True))
        seen = 0
        while True:
            if args.steps_file and sampler:
                n = count_lines(args.steps_file)
                if n != seen:
                    marks[n] = sampler.sent()
                    seen = n
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i, c = bad[0]
                rc, why = c, f"command {i + 1} exited with status {c}"
                break
            if all(c == 0 for c in codes):
                break
            if interrupted:
                rc, why = 130, f"interrupted ({interrupted[0]})"
                break
            if time.monotonic() - t0 > args.timeout:
                rc, why = 124, f"still running after --timeout {args.timeout:g} s"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            stop_group(p)
        end_sent = sampler.sent() if sampler else None
        if sampler:
            sampler.stop()
        for f in outs:
            f.flush()
    result["wall_s"] = time.monotonic() - t0
    result["load1_end"] = os.getloadavg()[0]  # 1-minute load average: other work on the machine shows here
    outs[0].seek(0)
    stdout0 = outs[0].read()
    for i, f in enumerate(outs):
        f.seek(0)
        text = f.read()
        if text:
            log.write(f"--- stdout of command {i + 1}\n{text}")
        f.close()
        os.unlink(args.log + f".stdout{i}")
    log.close()
    if why:
        result.update(ok=False, exit=rc, error=f"{why}: {last_error_line(args.log)}")
        print(json.dumps(result), flush=True)
        return 1 if rc != 130 else 130
    result["ok"] = True

    if args.parse == "json":
        lines = [l for l in stdout0.splitlines() if l.startswith("{")]
        if not lines:
            result.update(ok=False, error="the job printed no JSON result")
        else:
            theirs = json.loads(lines[-1])
            theirs.pop("row", None)
            result.update(theirs)
    elif args.parse == "comm":
        result["comm"] = parse_comm(stdout0)
        if not result["comm"]:
            result.update(ok=False, error="no table in the output of lattice bench comm")

    if args.steps_file:
        rows = read_jsonl(args.steps_file)
        if not rows:
            result.update(ok=False, error=f"the job wrote no step to {args.steps_file}")
        elif "comm_ms" in rows[0] or "tokens" in rows[0]:
            result.update(summarise_metrics(rows, args.warmup))
        else:
            ms = [r["step_ms"] for r in rows if r.get("step", 0) > args.warmup]
            if ms:
                result.setdefault("steps_timed", len(ms))
        steps = len(rows)
        # The counters when the last warm-up step's line appeared (or the closest earlier reading: short
        # steps can write several lines between two polls), and when the last line did.
        before = [n for n in marks if n <= args.warmup]
        first = marks[max(before)] if args.warmup > 0 and before else start_sent
        last = marks.get(steps)
        if sampler and first is not None and last is not None and steps > args.warmup:
            per_node = [(b - a) / (steps - args.warmup) for a, b in zip(first, last)]
            result["link_bytes_per_step_by_node"] = per_node
            result["link_bytes_per_step"] = sum(per_node)
    if sampler and start_sent is not None and end_sent is not None:
        result["link_bytes_total"] = sum(b - a for a, b in zip(start_sent, end_sent))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
