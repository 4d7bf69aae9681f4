#!/usr/bin/env python3
"""Turns bench_kernels JSON output into the tables of docs/kernels.md.

    ./build/bench/kernels/bench_kernels --benchmark_repetitions=3 \
        --benchmark_report_aggregates_only=true \
        --benchmark_out=kernels.json --benchmark_out_format=json
    python3 bench/kernels/summarize.py kernels.json

Each figure is the best of the repetitions (the "max" aggregate of a rate):
other processes on a shared machine only ever make a run slower.
"""
import json
import re
import sys
from collections import defaultdict


def main(path):
    data = json.load(open(path))
    best = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") not in ("max", None):
            continue
        name = re.sub(r"/min_time:[0-9.]+|/real_time", "", b["run_name"])
        for unit in ("GFLOP/s", "GB/s"):
            if unit in b:
                value = b[unit] / 1e9 if b[unit] > 1e6 else b[unit]
                best[name] = max(best.get(name, 0.0), value)
    # Milliseconds: the min aggregate of time.
    ms = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") not in ("min", None):
            continue
        name = re.sub(r"/min_time:[0-9.]+|/real_time", "", b["run_name"])
        t = b["real_time"] if "/threads:2" in name else b["cpu_time"]
        ms[name] = min(ms.get(name, float("inf")), t)

    gemm = defaultdict(dict)
    others = defaultdict(dict)
    for name, value in best.items():
        parts = name.split("/")
        threads = parts[-1].split(":")[1]
        if parts[0] == "gemm":
            _, shape, pas, backend, _ = parts
            gemm[(shape, pas)][(backend, threads)] = value
        else:
            others[tuple(parts[:-1])][threads] = (value, ms.get(name))

    backends = ["lattice", "dnnl_sgemm", "dnnl_matmul", "openblas", "lattice_bf16", "dnnl_matmul_bf16"]
    print("| shape | pass | " + " | ".join(f"{b} 1t / 2t" for b in backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for (shape, pas), row in gemm.items():
        if not row:
            continue
        cells = []
        for b in backends:
            one, two = row.get((b, "1")), row.get((b, "2"))
            cells.append(" / ".join(f"{v:.0f}" if v else "-" for v in (one, two)))
        print(f"| {shape} | {pas} | " + " | ".join(cells) + " |")
    print()
    print("| benchmark | 1 thread | 2 threads |")
    print("|---|---|---|")
    for key, row in others.items():
        unit = "GFLOP/s" if key[0].startswith(("linear", "attention")) else "GB/s"
        cells = []
        for t in ("1", "2"):
            if t in row:
                value, t_ms = row[t]
                cells.append(f"{value:.1f} {unit} ({t_ms:.2f} ms)")
            else:
                cells.append("-")
        print(f"| {'/'.join(key)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
