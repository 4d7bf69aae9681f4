#!/usr/bin/python3
"""PyTorch's BLAS at its best on this CPU: make sure it is OpenBLAS, pick OpenBLAS's core type.

    /usr/bin/python3 bench/torch_blas.py --threads 2 [--coretype NAME] [--recalibrate]

Prints one JSON line {"impl": "torch-blas", "openblas_coretype", "openblas_coretype_gflops",
"blas_library", ...} and a summary on stderr; exits 1 with one message when torch
cannot run on OpenBLAS here. bench/torch_gpt2_bench.py uses the same functions
before it starts, and bench/compare_gpt2.sh runs this once per thread count first.

Why. Debian's python3-torch (1.13, CPU) calls whatever libblas.so.3 the
alternatives system points at. With only libblas3 installed that is the
reference BLAS: one thread whatever is asked, ~8 GFLOP/s for a GPT-2 sized
sgemm on a Zen 5 core where OpenBLAS does ~230. A ratio against that says
nothing about lattice. So:
  1. OpenBLAS. If the libblas.so.3 alternative is not OpenBLAS, install
     Debian's libopenblas0-pthread (apt-get, as root or through sudo;
     python3-torch too if it is missing) and point the alternative at it; if
     the libblas torch then maps (read from /proc/self/maps in a child that
     imported torch) is still not OpenBLAS, stop.
  2. Core type. Debian's OpenBLAS 0.3.21 is built DYNAMIC_ARCH and detects its
     kernels from the CPUID family/model tables it knows; it takes CPUs newer
     than those for old ones (an Emerald Rapids Xeon came out as "Prescott":
     SSE3 kernels, 5x slow). OPENBLAS_CORETYPE, read when the library loads,
     overrides that. The candidates follow the CPU's flags: avx512f gives
     SkylakeX, and Cooperlake with avx512_bf16; avx2 gives Haswell and Zen
     (an AVX-512 CPU has AVX2 too, so it gets all four). Each candidate, and
     the library's own pick ("auto"), is timed in a child process (the
     variable must be set before torch loads OpenBLAS; with glibc's huge pages,
     as the benchmarks run: blas_env) on the GEMMs of a GPT-2
     block, 1024x768 . 768x3072 and 1024x3072 . 3072x768, at the thread count
     of the run, best of a few repetitions and of --rounds interleaved rounds
     (other tenants of a shared machine only slow a run down). The fastest
     total rate wins; candidates within 5% of it tie, and the tie goes to the
     first in the order above (SkylakeX and Cooperlake share their sgemm
     kernels, so the pick does not flip between runs). A candidate whose
     child dies (illegal instruction) or that the library does not know (it
     falls back to its own pick) is left out.
  3. Cache. The choice is kept per (CPU model, family/model, ISA, thread count,
     BLAS library) in $XDG_CACHE_HOME/lattice/openblas_coretype.json (default
     ~/.cache/lattice/), so repeated benchmark runs do not recalibrate;
     --recalibrate ignores the cache, --coretype NAME forces a core type (it is
     still probed once, to show that it runs and how fast).

The benchmark process then checks what it got (see check_loaded_blas and
gemm_rate): the mapped library is OpenBLAS with the chosen core, torch and
OpenBLAS both use the requested thread count, and a GEMM reaches a sane rate.
"""

import argparse
import ctypes
import datetime
import json
import os
import subprocess
import sys
import sysconfig
import time

# GPT-2 block GEMMs (M x K . K x N): the MLP's up projection and its down projection at 1024 tokens.
GEMM_SHAPES = ((1024, 768, 3072), (1024, 3072, 768))
CACHE_VERSION = 2  # 2: probes run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (blas_env)
TIE = 0.95  # candidates within 5% of the fastest are equally fast (run-to-run noise on a shared VM is about that)


class SetupError(Exception):
    """Torch cannot run on a usable OpenBLAS here; the message says what was found and what to do."""


def add_step_benchmark_args(ap, batch_help=None, threads_help=None):
    """The options the PyTorch step benchmarks share (model, batch, timing, BLAS)."""
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4, help=batch_help)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help=threads_help)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--coretype", default=None,
                    help="force this OPENBLAS_CORETYPE (default: the fastest candidate for this CPU, measured once "
                         "per CPU and thread count and cached)")
    ap.add_argument("--recalibrate", action="store_true", help="measure the core type candidates again")
    ap.add_argument("--min-gemm-gflops-per-thread", type=float, default=20.0,
                    help="refuse to run when torch.matmul at 1024x768x3072 is below this many GFLOP/s times "
                         "--threads (default 20: reference BLAS ~8 in all, OpenBLAS 40-250 per thread)")
    ap.add_argument("--foreach", choices=["on", "off"], default="off",
                    help="torch.optim.AdamW foreach implementation (default off, torch 1.13's CPU default; "
                         "on was not faster here)")
    ap.add_argument("--seed", type=int, default=0)


def check_step_benchmark_args(ap, args, positive=()):
    """Refuses what add_step_benchmark_args' options (and `positive` others) cannot be."""
    for k in ("n_layer", "n_head", "n_embd", "vocab", "batch", "seq", "threads", "steps") + tuple(positive):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.n_embd % args.n_head:
        ap.error(f"--n-head {args.n_head} does not divide --n-embd {args.n_embd}")


def log(msg):
    print(f"torch_blas: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The CPU

def cpu_identity():
    """Vendor, model name, family/model, flags and ISA level of cpu0, from /proc/cpuinfo."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # first processor only
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return {
        "model_name": info.get("model name", "unknown CPU"),
        "vendor": info.get("vendor_id", "?"),
        "family": info.get("cpu family", "?"),
        "model": info.get("model", "?"),
        "flags": flags,
        "isa": isa,
        "bf16": "avx512_bf16" in flags,
    }


def cpu_description(cpu):
    extra = " +avx512_bf16" if cpu["bf16"] else ""
    return f"{cpu['model_name']} ({cpu['vendor']} family {cpu['family']} model {cpu['model']}), {cpu['isa']}{extra}"


def candidate_coretypes(flags):
    """OpenBLAS core types this CPU can run whose sgemm kernels might be the fastest here."""
    out = []
    if "avx512f" in flags:
        out.append("SkylakeX")
        if "avx512_bf16" in flags:
            out.append("Cooperlake")
    if "avx2" in flags:
        out += ["Haswell", "Zen"]
    return out


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Packages and the libblas.so.3 alternative (Debian)

def multiarch():
    return sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"


def blas_alternative():
    """(current value, highest priority, [all]) of Debian's libblas.so.3 alternative; (None, None, []) without one."""
    try:
        r = subprocess.run(["update-alternatives", "--query", f"libblas.so.3-{multiarch()}"],
                           capture_output=True, text=True)
    except OSError:
        return None, None, []
    if r.returncode != 0:
        return None, None, []
    value, best, alts = None, None, []
    for line in r.stdout.splitlines():
        key, _, v = line.partition(":")
        if key == "Value":
            value = v.strip()
        elif key == "Best":
            best = v.strip()
        elif key == "Alternative":
            alts.append(v.strip())
    return value, best, alts


def is_openblas_path(path):
    return path is not None and "openblas" in os.path.realpath(path).lower()


def dpkg_status(pkg):
    """dpkg's two-letter status of pkg ("ii" = installed and configured), or "" when unknown."""
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", pkg], capture_output=True, text=True)
    except OSError:
        return ""
    return r.stdout.strip()[:2] if r.returncode == 0 else ""


def as_root(cmd):
    """cmd as root: directly when we are root, through sudo otherwise; None when neither is possible."""
    if os.geteuid() == 0:
        return cmd
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        if os.access(os.path.join(d, "sudo"), os.X_OK):
            return ["sudo"] + cmd
    return None


def apt_install(pkgs):
    """Install Debian packages; waits up to 20 minutes for another apt/dpkg run to finish."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = as_root(["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=1200"] + pkgs)
    if install is None:
        raise SetupError(f"{' '.join(pkgs)} must be installed and this user is neither root nor has sudo: "
                         f"run 'apt-get install {' '.join(pkgs)}' as root")
    log(f"installing {' '.join(pkgs)}: {' '.join(install)}")
    try:
        r = subprocess.run(install, env=env, stdout=subprocess.DEVNULL)
        if r.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(as_root(["apt-get", "update", "-qq", "-o", "DPkg::Lock::Timeout=1200"]), env=env,
                           stdout=subprocess.DEVNULL)
            r = subprocess.run(install, env=env, stdout=subprocess.DEVNULL)
    except OSError as e:
        raise SetupError(f"cannot run apt-get to install {' '.join(pkgs)}: {e}")
    if r.returncode != 0:
        raise SetupError(f"'{' '.join(install)}' failed (exit {r.returncode})")


def ensure_torch():
    """python3-torch installed and configured (apt waits for an install already in progress)."""
    if dpkg_status("python3-torch") == "ii":
        return
    try:  # a torch from elsewhere (pip) is used as it is
        if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
            return
    except OSError:
        pass
    apt_install(["python3-torch"])
    status = dpkg_status("python3-torch")
    if status != "ii":
        raise SetupError(f"python3-torch is in dpkg state '{status}' after apt-get install, not 'ii' "
                         "(installed); finish it with 'dpkg --configure -a' as root")


def point_blas_at_openblas():
    """Install libopenblas0-pthread if needed and make the libblas.so.3 alternative point at OpenBLAS."""
    value, best, alts = blas_alternative()
    if is_openblas_path(value):
        return
    if not any(is_openblas_path(a) for a in alts):
        apt_install(["libopenblas0-pthread"])
        value, best, alts = blas_alternative()
        if is_openblas_path(value):  # installing it switches an alternative in auto mode
            return
    openblas = sorted((a for a in alts if is_openblas_path(a)), key=lambda a: "pthread" not in a)
    if not openblas:
        raise SetupError(f"no OpenBLAS libblas.so.3 alternative after installing libopenblas0-pthread "
                         f"(alternatives: {alts or 'none'})")
    name = f"libblas.so.3-{multiarch()}"
    # Back to auto mode when that picks OpenBLAS (it has the highest priority), else set it by hand.
    change = ["update-alternatives", "--auto", name] if is_openblas_path(best) else \
        ["update-alternatives", "--set", name, openblas[0]]
    cmd = as_root(change)
    if cmd is None:
        raise SetupError(f"libblas.so.3 points at {value}, not OpenBLAS, and this user cannot change it: run "
                         f"'{' '.join(change)}' as root")
    log(f"pointing libblas.so.3 at {best if is_openblas_path(best) else openblas[0]} (was {value}): {' '.join(cmd)}")
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)


# ---------------------------------------------------------------------------------------------
# Inside a process that has imported torch

def mapped_blas_files():
    """Real paths of the BLAS shared objects mapped into this process (libblas*, libopenblas*)."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            base = os.path.basename(path)
            if (base.startswith("libblas") or base.startswith("libopenblas")) and path not in found:
                found.append(path)
    return found


def openblas_handle(path):
    """A ctypes handle to OpenBLAS through path, or None when path is some other BLAS.

    dlopen of a loaded path returns that copy, and dlsym searches its dependencies too: Debian's
    openblas-pthread/libblas.so.3 is a thin wrapper over libopenblas.so.0."""
    try:
        lib = ctypes.CDLL(path)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        return lib
    except (OSError, AttributeError):
        return None


def loaded_blas(threads=None):
    """What this process's torch runs on. Sets OpenBLAS's thread count first when threads is given.

    The BLAS torch calls is the libblas.so.3 it links (a libopenblas mapped beside it, e.g. through the
    liblapack.so.3 alternative, does not make the reference libblas fast), or a libopenblas when torch
    links that directly."""
    paths = mapped_blas_files()
    libblas = [p for p in paths if os.path.basename(p).startswith("libblas")] or paths
    path = libblas[0] if libblas else None
    lib = openblas_handle(path) if path else None
    out = {"blas_library": path, "blas_mapped": paths, "is_openblas": lib is not None}
    if lib is not None:
        if threads is not None:
            lib.openblas_set_num_threads(threads)
        out.update(blas_config=lib.openblas_get_config().decode(), blas_core=lib.openblas_get_corename().decode(),
                   openblas_threads=lib.openblas_get_num_threads())
    return out


def gemm_rate(torch, m, k, n, reps):
    """Best-of-reps GFLOP/s of torch.matmul on an (m x k) . (k x n) fp32 product (one untimed call first)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9


def probe_main(threads, reps):
    """Child: report the loaded BLAS and its GEMM rates as one JSON line."""
    import torch
    torch.set_num_threads(threads)
    out = loaded_blas(threads)
    out["torch"] = torch.__version__
    out["torch_threads"] = torch.get_num_threads()
    rates = {}
    for m, k, n in GEMM_SHAPES:
        rates[f"{m}x{k}x{n}"] = gemm_rate(torch, m, k, n, reps)
    out["gflops"] = rates
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# Probing and choosing a core type

def blas_env(coretype, threads):
    """Environment for a process that will load OpenBLAS: core type (None = its own pick) and threads,
    and glibc's huge pages for large allocations unless the environment sets GLIBC_TUNABLES: without
    them every large tensor is fresh 4 KiB pages, and a page fault's cost is up to the VM's host (on
    the Zen 5 VM of 2026-12-02 the 1024x768x3072 probe read 78 GFLOP/s on most core types and 188 on
    others, from one run to the next; with huge pages 183-194 on all of those that share the kernel).
    The benchmarks run with the same (bench/torch_gpt2_bench.py's docstring)."""
    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)
    env.pop("OPENBLAS_VERBOSE", None)
    return env


def probe(coretype, threads, reps=4):
    """Run probe_main in a child with OPENBLAS_CORETYPE=coretype; its JSON, or {"error": why}."""
    env = blas_env(coretype, threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", "--threads", str(threads), "--reps", str(reps)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        tail = r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else []
        return {"error": why + (f": {tail[0]}" if tail else "")}
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return {"error": "no output"}
    return json.loads(lines[-1])


def total_rate(rates):
    """Rate over all GEMM_SHAPES together: total FLOPs over total best time."""
    flops = {f"{m}x{k}x{n}": 2.0 * m * k * n for m, k, n in GEMM_SHAPES}
    return sum(flops.values()) / sum(flops[s] / r for s, r in rates.items())


def calibrate(candidates, threads, rounds, reps):
    """Time every candidate (and "auto", the library's own pick) in `rounds` interleaved rounds.

    Returns (results, probe_info): results[name] = {"gflops": {shape: best}, "total": ..., "core": corename}
    or {"error": why}; probe_info describes the loaded library (from the auto probe)."""
    results, info = {}, None
    for _ in range(rounds):
        for name in ["auto"] + candidates:
            if "error" in results.get(name, {}):
                continue
            p = probe(None if name == "auto" else name, threads, reps)
            if "error" in p:
                results[name] = {"error": p["error"]}
                continue
            if not p["is_openblas"]:
                return results, p
            if name == "auto":
                info = p
            elif p["blas_core"].lower() != name.lower():
                results[name] = {"error": f"this OpenBLAS ran '{p['blas_core']}' instead (no such core type here?)"}
                continue
            prev = results.setdefault(name, {"gflops": {}, "core": p["blas_core"]})
            for shape, rate in p["gflops"].items():
                prev["gflops"][shape] = max(prev["gflops"].get(shape, 0.0), rate)
    for r in results.values():
        if "gflops" in r:
            r["total"] = total_rate(r["gflops"])
    return results, info


def cache_path():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lattice", "openblas_coretype.json")


def cache_key(cpu, threads):
    return (f"{cpu['model_name']} | {cpu['vendor']} family {cpu['family']} model {cpu['model']} | "
            f"{cpu['isa']}{'+bf16' if cpu['bf16'] else ''} | threads {threads}")


def read_cache():
    try:
        with open(cache_path()) as f:
            d = json.load(f)
        return d if d.get("version") == CACHE_VERSION else {"version": CACHE_VERSION}
    except (OSError, ValueError):
        return {"version": CACHE_VERSION}


def write_cache(d):
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log(f"could not write the core type cache {path}: {e}")


def fmt_rates(results, chosen=None, by_shape=True):
    """'SkylakeX * 237.4 (1024x768x3072 236.0, ...); ...': total GFLOP/s per candidate, * = chosen."""
    parts = []
    for name, r in results.items():
        if "error" in r:
            parts.append(f"{name} failed ({r['error']})")
        else:
            label = f"auto={r['core']}" if name == "auto" else name
            per = " (" + ", ".join(f"{s} {g:.1f}" for s, g in r["gflops"].items()) + ")" if by_shape else ""
            parts.append(f"{label}{' *' if name == chosen else ''} {r['total']:.1f}{per}")
    return "; ".join(parts)


def prepare(threads, coretype=None, recalibrate=False, rounds=2, reps=4):
    """Make torch run on OpenBLAS and choose its core type for `threads` threads.

    Returns {"openblas_coretype", "openblas_coretype_gflops" (total GFLOP/s per measured candidate),
    "openblas_coretype_source" ("calibrated", "cache" or "forced"), "blas_library", "cpu", ...}.
    Raises SetupError when torch cannot be made to run on OpenBLAS here."""
    cpu = cpu_identity()
    if threads > usable_cpus():
        raise SetupError(f"--threads {threads} is more than the {usable_cpus()} CPUs this process may run on; "
                         "the reference would be timed oversubscribed")
    ensure_torch()
    alt_value = blas_alternative()[0]
    if alt_value is not None and not is_openblas_path(alt_value):  # None: no Debian alternative to fix
        point_blas_at_openblas()
        alt_value = blas_alternative()[0]
    blas_real = os.path.realpath(alt_value) if alt_value else None

    key = cache_key(cpu, threads)
    cache = read_cache()
    entry = cache.get("entries", {}).get(key)
    if coretype is None and not recalibrate and entry and entry.get("blas_library_real") == blas_real:
        log(f"{threads} thread(s): OpenBLAS core type {entry['openblas_coretype']} (cached in {cache_path()}, "
            f"chosen {entry['when']}; --recalibrate to measure again): {entry['summary']}")
        return dict(entry, openblas_coretype_source="cache", cpu=cpu_description(cpu))

    candidates = [coretype] if coretype else candidate_coretypes(cpu["flags"])
    results, info = calibrate(candidates, threads, rounds if not coretype else 1, reps)
    if info is None or not info.get("is_openblas"):
        auto_err = results.get("auto", {}).get("error")
        if auto_err:
            raise SetupError(f"the probe that imports torch with {sys.executable} failed ({auto_err})")
        ld_path = os.environ.get("LD_LIBRARY_PATH")
        raise SetupError(f"torch runs on {(info or {}).get('blas_library') or 'no mapped BLAS'}, not OpenBLAS "
                         f"(libblas.so.3 alternative: {alt_value}"
                         + (f"; LD_LIBRARY_PATH={ld_path} may override it" if ld_path else "") +
                         "); no ratio against the reference BLAS")
    ok = {n: r for n, r in results.items() if "total" in r}
    pick_from = {n: r for n, r in ok.items() if n != "auto" or not coretype}
    if coretype and coretype not in ok:
        raise SetupError(f"--coretype {coretype} does not run here: {results.get(coretype, {}).get('error')}")
    if not pick_from:
        raise SetupError(f"no OpenBLAS core type ran on this CPU ({cpu_description(cpu)}): {fmt_rates(results)}")
    # Within TIE of the fastest counts as a tie, won by the earlier candidate: core types sharing one sgemm
    # kernel (SkylakeX and Cooperlake) then come out the same way on every calibration.
    top = max(r["total"] for r in pick_from.values())
    best = coretype or next(n for n in candidates + ["auto"]
                            if n in pick_from and pick_from[n]["total"] >= TIE * top)
    chosen = ok[best]["core"] if best == "auto" else best
    summary = fmt_rates(results, best, by_shape=False) + " GFLOP/s"
    log(f"{threads} thread(s), {cpu_description(cpu)}, {info['blas_library']}: "
        f"{fmt_rates(results, best)} GFLOP/s -> {chosen}"
        + (" (forced by --coretype)" if coretype else ""))
    out = {
        "openblas_coretype": chosen,
        "openblas_coretype_gflops": {n: round(r["total"], 2) for n, r in ok.items()},
        "openblas_coretype_gflops_by_shape": {n: {s: round(g, 2) for s, g in r["gflops"].items()}
                                              for n, r in ok.items()},
        "openblas_coretype_failed": {n: r["error"] for n, r in results.items() if "error" in r},
        "openblas_auto_core": ok.get("auto", {}).get("core"),
        "blas_library": info["blas_library"],
        "blas_library_real": blas_real,
        "blas_config": info.get("blas_config"),
        "threads": threads,
        "summary": summary,
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if not coretype:
        cache.setdefault("entries", {})[key] = out
        write_cache(cache)
    return dict(out, openblas_coretype_source="forced" if coretype else "calibrated", cpu=cpu_description(cpu))


def check_loaded_blas(torch, threads, coretype):
    """In the benchmark process, after `import torch`: OpenBLAS mapped, the chosen core, `threads` threads.

    Returns loaded_blas()'s dict; raises SetupError naming what is wrong."""
    torch.set_num_threads(threads)
    got = loaded_blas(threads)
    if not got["is_openblas"]:
        raise SetupError(f"torch runs on {got['blas_library'] or 'no mapped BLAS'}, not OpenBLAS; "
                         "no ratio against the reference BLAS")
    if coretype and got["blas_core"].lower() != coretype.lower():
        raise SetupError(f"OpenBLAS runs core type {got['blas_core']}, not the {coretype} asked for "
                         f"({got['blas_library']})")
    if torch.get_num_threads() != threads or got["openblas_threads"] != threads:
        raise SetupError(f"asked for {threads} threads, got torch {torch.get_num_threads()} and OpenBLAS "
                         f"{got['openblas_threads']} ({got['blas_library']})")
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="thread count the core type is chosen for")
    ap.add_argument("--coretype", default=None, help="force this OPENBLAS_CORETYPE (still probed once)")
    ap.add_argument("--recalibrate", action="store_true", help="measure the candidates again, ignore the cache")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per candidate")
    ap.add_argument("--reps", type=int, default=4, help="timed repetitions of each GEMM per probe (best of)")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads <= 0 or args.rounds <= 0 or args.reps <= 0:
        ap.error("--threads, --rounds and --reps must be positive")
    if args.probe:
        probe_main(args.threads, args.reps)
        return
    try:
        out = prepare(args.threads, args.coretype, args.recalibrate, args.rounds, args.reps)
    except SetupError as e:
        print(f"torch_blas.py: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(dict(impl="torch-blas", **out)))


if __name__ == "__main__":
    main()
