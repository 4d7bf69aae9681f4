#!/usr/bin/python3
"""The tables of bench/cluster_bench.sh from its results (JSON lines of bench/cluster_row.py).

    bench/cluster_table.py results.jsonl

A row run more than once (a results file appended to by several runs) shows its
latest successful result.
"""

import json
import re
import sys

RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def rate_bytes(rate):
    """tc's rate in bytes per second ("1gbit" -> 1.25e8), or None."""
    m = re.fullmatch(r"([\d.]+)(kbit|mbit|gbit)", rate or "")
    return float(m.group(1)) * RATE_UNITS[m.group(2)] if m else None


def rate_key(rate):
    return rate_bytes(rate) or 0


def fmt(v, spec, width=None):
    if v is None:
        s = "-"
    else:
        s = format(v, spec)
    return s.rjust(width) if width else s


def pct(v, width=0):
    return ("-" if v is None else f"{100 * v:.0f}%").rjust(width)


def ratio(a, b):
    return a / b if a is not None and b else None


class Results:
    def __init__(self, path):
        self.rows, self.machine, self.end = {}, {}, {}
        for line in open(path):
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            name = d.get("row")
            if name == "_machine":
                self.machine = d
            elif name == "_end":
                self.end = d
            elif name:
                old = self.rows.get(name)
                if old is None or d.get("ok") or not old.get("ok"):
                    self.rows[name] = d

    def get(self, name):
        """The row's result if it succeeded, else None."""
        d = self.rows.get(name)
        return d if d and d.get("ok") else None

    def rates(self, section):
        rates = {d.get("rate") for d in self.rows.values() if d.get("section") == section and d.get("rate")}
        return sorted(rates, key=rate_key)

    def failures(self):
        return [(n, d) for n, d in self.rows.items() if not d.get("ok")]


def header(r):
    m = r.machine
    print(f"CPU: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, Linux {m.get('kernel', '?')}; "
          f"{m.get('date_start', '?')} to {r.end.get('date_end', '?')}; 1-min load average "
          f"{fmt(m.get('load1_start'), '.2f')} at the start, {fmt(r.end.get('load1_end'), '.2f')} at the end "
          "(2 is this benchmark's own 2 ranks; more is other work)")
    big, small = m.get("big_model", "?").split(), m.get("small_model", "?").split()
    desc = lambda f: (f"L={f[0]} H={f[1]} C={f[2]} V={f[3]} T={f[4]}, micro-batch {f[5]} per rank" if len(f) == 6
                      else "?")
    print(f"models: dp2 rows {desc(big)}; codec/layout/2x2 rows {desc(small)}; fp32, 1 thread per rank, "
          f"{m.get('warmup', '?')} warm-up + {m.get('steps', '?')} timed steps; 2 nodes x 1 rank "
          + ("pinned to cores 0 and 1" if m.get("bind") == "core" else "unpinned (--bind none)")
          + (" -- --quick: a smoke test, not a measurement" if m.get("quick") else ""))
    loaded = [n for n, d in r.rows.items() if d.get("ok") and max(d.get("load1_start", 0), d.get("load1_end", 0)) > 3]
    if loaded:
        print(f"! load average above 3 during {len(loaded)} row(s) ({', '.join(sorted(loaded)[:6])}"
              f"{'...' if len(loaded) > 6 else ''}): other work shared the cores; their timings are suspect")


def comm_table(r):
    node, link = r.get("comm-node"), r.get("comm-link")
    if not node and not link:
        return
    print("\n1. lattice bench comm, 2 ranks: inside node0 (shared memory) and across the link (2 nodes x 1 rank, "
          "1gbit = 0.125 GB/s each way); busbw GB/s, fastest round; lattice's and raw MPI's")
    ops = list((node or link)["comm"].keys())
    for op in ops:
        a = {e["bytes"]: e for e in (node or {}).get("comm", {}).get(op, [])}
        b = {e["bytes"]: e for e in (link or {}).get("comm", {}).get(op, [])}
        sizes = sorted(set(a) | set(b))
        h = (f"  {op:<15} {'size':>8} | {'node lat':>8} {'raw':>7} | {'link lat':>8} {'raw':>7} | "
             f"{'link/node':>9} {'lat/raw':>7}")
        print(h)
        for s in sizes:
            x, y = a.get(s), b.get(s)
            size = f"{s // 1048576} MiB" if s >= 1048576 else f"{s // 1024} KiB"
            print(f"  {'':<15} {size:>8} | {fmt(x and x['lattice_busbw'], '.3f', 8)} {fmt(x and x['raw_busbw'], '.3f', 7)}"
                  f" | {fmt(y and y['lattice_busbw'], '.3f', 8)} {fmt(y and y['raw_busbw'], '.3f', 7)} | "
                  f"{fmt(ratio(y and y['lattice_busbw'], x and x['lattice_busbw']), '.3f', 9)} "
                  f"{fmt(ratio(y and y['lattice_busbw'], y and y['raw_busbw']), '.2f', 7)}")


def probe_busbw(r, rate, size):
    d = r.get(f"probe@{rate}")
    for e in (d or {}).get("comm", {}).get("all_reduce", []):
        if e["bytes"] == size:
            return e["lattice_busbw"], e["raw_busbw"]
    return None, None


def probe_table(r):
    rates = r.rates("probe")
    if not rates:
        return
    print("\nthe link at each rate: all_reduce across it (lattice bench comm, 2 nodes x 1 rank), busbw GB/s")
    print(f"  {'rate':>7} {'shaped':>7} | {'4 MiB':>6} {'raw':>6} | {'16 MiB':>6} {'raw':>6} | {'16 MiB/shaped':>13}")
    for rate in rates:
        a, ar = probe_busbw(r, rate, 4 << 20)
        b, br = probe_busbw(r, rate, 16 << 20)
        shaped = rate_bytes(rate) / 1e9
        print(f"  {rate:>7} {shaped:7.3f} | {fmt(a, '.3f', 6)} {fmt(ar, '.3f', 6)} | {fmt(b, '.3f', 6)} "
              f"{fmt(br, '.3f', 6)} | {pct(ratio(b, shaped), 13)}")


def dp2_table(r):
    rates = r.rates("dp2")
    if not rates:
        return
    print("\n2. dp=2 across the link, overlap on (thread) and off (inline), GPT-2 124M rows")
    print("  compute s = inline step - inline exposed (no overlap: all of the communication is exposed); "
          "bwd s ~ 2/3 of it (backward:forward FLOPs 2:1);")
    print("  transfer s = inline comm s (the collectives' run time with nothing beside them); hidden (wall) = "
          "(inline step - thread step) / inline exposed")
    h = (f"  {'rate':>7} | {'thread':>7} {'inline':>7} {'x':>5} | {'comm s':>6} {'exp s':>6} {'hidden':>6} | "
         f"{'transfer s':>10} {'compute s':>9} {'bwd s':>6} | {'hidden (wall)':>13} | {'link MB/step':>12}")
    print("  (link MB/step: both nodes' bytes into their links per step, thread row)")
    print(h)
    targets = []
    for rate in rates:
        t, i = r.get(f"dp2-thread@{rate}"), r.get(f"dp2-inline@{rate}")
        tt, it = (t or {}).get("tokens_per_sec"), (i or {}).get("tokens_per_sec")
        compute = transfer = bwd = wall_hidden = None
        if i:
            compute = (i["step_ms"] - i.get("comm_exposed_ms", 0)) / 1e3
            transfer = i.get("comm_ms", 0) / 1e3
            bwd = 2 / 3 * compute
        if t and i and i.get("comm_exposed_ms"):
            wall_hidden = (i["step_ms"] - t["step_ms"]) / i["comm_exposed_ms"]
        print(f"  {rate:>7} | {fmt(tt, '.1f', 7)} {fmt(it, '.1f', 7)} {fmt(ratio(tt, it), '.2f', 5)} | "
              f"{fmt(t and t.get('comm_ms', 0) / 1e3, '.2f', 6)} {fmt(t and t.get('comm_exposed_ms', 0) / 1e3, '.2f', 6)} "
              f"{pct(t and t.get('comm_hidden'), 6)} | {fmt(transfer, '.2f', 10)} {fmt(compute, '.2f', 9)} "
              f"{fmt(bwd, '.2f', 6)} | {pct(wall_hidden, 13)} | "
              f"{fmt(t and t.get('link_bytes_per_step') and t['link_bytes_per_step'] / 1e6, '.1f', 12)}")
        if bwd is not None and transfer is not None:
            targets.append((rate, bwd, transfer, wall_hidden, t and t.get("comm_hidden")))
    ddp_rows = [(rate, r.get(f"ddp@{rate}")) for rate in rates]
    if any(d for _, d in ddp_rows):
        print("\n  beside PyTorch DDP (gloo, bucket_cap_mb 25), same model, batch and nodes; DDP's comm and overlap "
              "are its own logged averages (backward communication, and the part overlapping backward compute)")
        print(f"  {'rate':>7} | {'lattice':>7} {'DDP':>7} {'x':>5} | {'DDP comm s':>10} {'overlap s':>9} "
              f"{'hidden':>6} | {'DDP link MB/step':>16}")
        for rate, d in ddp_rows:
            t = r.get(f"dp2-thread@{rate}")
            tt, dt = (t or {}).get("tokens_per_sec"), (d or {}).get("tokens_per_sec")
            comm, over = (d or {}).get("ddp_backward_comm_ms"), (d or {}).get("ddp_backward_compute_comm_overlap_ms")
            print(f"  {rate:>7} | {fmt(tt, '.1f', 7)} {fmt(dt, '.1f', 7)} {fmt(ratio(tt, dt), '.2f', 5)} | "
                  f"{fmt(comm and comm / 1e3, '.2f', 10)} {fmt(over and over / 1e3, '.2f', 9)} {pct(ratio(over, comm), 6)}"
                  f" | {fmt(d and d.get('link_bytes_per_step') and d['link_bytes_per_step'] / 1e6, '.1f', 16)}")
    if targets:
        print("\n  target: >= 80% of the communication hidden where the backward outlasts the transfer")
        for rate, bwd, transfer, wall, metric in targets:
            if bwd < transfer:
                print(f"    n/a   {rate}: bwd ~{bwd:.2f} s < transfer {transfer:.2f} s (hidden (wall) "
                      f"{pct(wall)}, lattice's metric {pct(metric)})")
            else:
                ok = wall is not None and wall >= 0.8
                print(f"    {'PASS' if ok else 'MISS'}  {rate}: bwd ~{bwd:.2f} s >= transfer {transfer:.2f} s: hidden "
                      f"(wall) {pct(wall)}, lattice's metric {pct(metric)}")


def codec_table(r):
    rates = r.rates("codec")
    if not rates:
        return
    codecs = []
    for d in r.rows.values():
        if d.get("section") == "codec" and d.get("codec") not in codecs:
            codecs.append(d["codec"])
    order = ["none", "bf16", "f16", "int8", "onebit", "topk", "powersgd"]
    codecs.sort(key=lambda c: order.index(c) if c in order else len(order))
    print("\n3. gradient codecs at dp=2 across the link (smaller model); tok/s and x none at the same rate; "
          "bytes = grad_bytes per step and its share of uncompressed")
    h = f"  {'codec':<9} {'grad MB':>8} {'share':>6} | " + " | ".join(f"{rate:>14}" for rate in rates) + " | pays at"
    print(h)
    for c in codecs:
        got = [r.get(f"codec-{c}@{rate}") for rate in rates]
        any_d = next((d for d in got if d), None)
        gb = (any_d or {}).get("grad_bytes")
        gu = (any_d or {}).get("grad_bytes_uncompressed")
        if c == "none" and any_d:
            gb = gu = any_d.get("comm_bytes")  # uncompressed: the reductions' bytes
        cells, pays = [], []
        for rate, d in zip(rates, got):
            base = r.get(f"codec-none@{rate}")
            t = (d or {}).get("tokens_per_sec")
            x = ratio(t, (base or {}).get("tokens_per_sec"))
            cells.append(f"{fmt(t, '.1f', 7)} {fmt(x, '.2f', 5)}x" if d else f"{'failed' if r.rows.get(f'codec-{c}@{rate}') else '-':>14}")
            if c != "none" and x is not None:
                pays.append((rate, x))
        verdict = ""
        if pays:
            yes = [rate for rate, x in pays if x > 1.05]
            no = [rate for rate, x in pays if x <= 1.05]
            verdict = ("faster (>1.05x) at " + ", ".join(yes) if yes else "never faster here") + \
                      ("; not at " + ", ".join(no) if yes and no else "")
        print(f"  {c:<9} {fmt(gb and gb / 1e6, '.2f', 8)} {pct(ratio(gb, gu), 6)} | " + " | ".join(cells)
              + (f" | {verdict}" if verdict else ""))


def layout_table(r):
    rates = r.rates("layout")
    if not rates:
        return
    print("\n4. tp=2 vs pp=2 vs dp=2 across the link, the smaller model, global batch the same (dp2: the codec-none "
          "row); x dp2 = against dp=2 at the same rate")
    print("  link MB/step: both nodes' bytes into their links; lattice MB: rank 0's own count per step (DP: comm_bytes;"
          " TP: tp_comm_bytes; PP: pp_comm_bytes, activations and the tied embedding's gradient sum between the stages)")
    h = (f"  {'rate':>7} {'layout':<6} | {'tok/s':>7} {'x dp2':>6} | {'link MB/step':>12} {'x dp2':>6} | "
         f"{'lattice MB':>10} | {'TP comm s':>9} {'bubble':>6}")
    print(h)
    for rate in rates:
        dp = r.get(f"codec-none@{rate}")
        for name, d in (("dp2", dp), ("tp2", r.get(f"layout-tp2@{rate}")), ("pp2", r.get(f"layout-pp2@{rate}"))):
            if not d:
                failed = r.rows.get(f"layout-{name}@{rate}") or (name == "dp2" and r.rows.get(f"codec-none@{rate}"))
                print(f"  {rate:>7} {name:<6} | {'failed' if failed else '-':>7}")
                continue
            t, lb = d.get("tokens_per_sec"), d.get("link_bytes_per_step")
            own = {"tp2": d.get("tp_comm_bytes"), "dp2": d.get("comm_bytes"), "pp2": d.get("pp_comm_bytes")}[name]
            print(f"  {rate:>7} {name:<6} | {fmt(t, '.1f', 7)} {fmt(ratio(t, (dp or {}).get('tokens_per_sec')), '.2f', 6)} | "
                  f"{fmt(lb and lb / 1e6, '.1f', 12)} {fmt(ratio(lb, (dp or {}).get('link_bytes_per_step')), '.2f', 6)} | "
                  f"{fmt(own and own / 1e6, '.1f', 10)} | {fmt(d.get('tp_comm_ms') and d['tp_comm_ms'] / 1e3, '.2f', 9)} "
                  f"{pct(d.get('pp_bubble'), 6)}")


def two_by_two_table(r):
    rows = [(n, r.rows[n]) for n in ("2x2-tp-inside", "2x2-tp-across") if n in r.rows]
    if not rows:
        return
    print("\n5. dp=2 x tp=2 on 2 nodes x 2 ranks (4 ranks on 2 cores: bytes and memory only), the smaller model")
    print(f"  {'TP groups':<12} | {'link MB/step':>12} {'node0':>8} {'node1':>8} | {'TP MB (r0)':>10} "
          f"{'DP MB (r0)':>10} | {'peak MiB':>8}")
    for n, d in rows:
        if not d.get("ok"):
            print(f"  {n[4:]:<12} | failed: {d.get('error')}")
            continue
        by = d.get("link_bytes_per_step_by_node") or [None, None]
        mb = lambda v: v and v / 1e6
        print(f"  {n[4:]:<12} | {fmt(mb(d.get('link_bytes_per_step')), '.1f', 12)} {fmt(mb(by[0]), '.1f', 8)} "
              f"{fmt(mb(by[1]), '.1f', 8)} | {fmt(mb(d.get('tp_comm_bytes')), '.1f', 10)} "
              f"{fmt(mb(d.get('comm_bytes')), '.1f', 10)} | {fmt(d.get('peak_mem_bytes') and d['peak_mem_bytes'] / 2**20, '.0f', 8)}")


def main():
    if len(sys.argv) != 2:
        print("usage: bench/cluster_table.py results.jsonl", file=sys.stderr)
        return 2
    r = Results(sys.argv[1])
    header(r)
    comm_table(r)
    probe_table(r)
    dp2_table(r)
    codec_table(r)
    layout_table(r)
    two_by_two_table(r)
    fails = r.failures()
    if fails:
        print("\nfailed rows:")
        for n, d in fails:
            print(f"  {n}: {d.get('error')} (log: {d.get('log')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
