"""The results file the bench/compare_*.sh drivers write (bench/common.sh's
time_row): one line per run, "row<TAB>run<TAB>JSON", a "_peak" row for the
machine's measured peak."""
import json


class Rows:
    def __init__(self, path):
        self.runs, self.order, self.peak = {}, [], None
        for line in open(path):
            row, _run, js = line.rstrip("\n").split("\t", 2)
            d = json.loads(js)
            if row == "_peak":
                self.peak = d
                continue
            self.runs.setdefault(row, []).append(d)
            if row not in self.order:
                self.order.append(row)

    @staticmethod
    def tps(d):
        """Tokens/s of a successful run, else None."""
        return d.get("tokens_per_sec") if d and not d.get("failed") else None

    def best_and_range(self, row):
        """The fastest successful run of a row (other load only slows a run down) and (min, max) tokens/s."""
        ok = [d for d in self.runs.get(row, []) if self.tps(d)]
        if not ok:
            return None, None
        return max(ok, key=self.tps), (min(map(self.tps, ok)), max(map(self.tps, ok)))

    def best(self, row):
        return self.best_and_range(row)[0]


# Where a PyTorch step went (bench/torch_gpt2_bench.py's profiled step: gemm_ms, other_ms,
# gemm_share, other_top) and whether the run is a fair reference.
#
# The same PyTorch on the same CPU model has run GPT-2 124M (B=4, T=256, one thread) at
# 214.5 tok/s (docs/performance.md, 2026-12-01) and at 82.1 tok/s (issue 19), 2.6x
# slower: the slow run's profile spent 4.95 s in mm and ~8 s elsewhere (log-softmax and
# its backward 2.4 s, copy_ 1.6 s, fill_ 1.3 s, GELU 0.7 s), 62% of its step outside the
# GEMMs. The healthy run's share is ~30% at most: its 4774 ms step holds ~788 GFLOP of
# GEMMs (the linear layers' 759, attention's 29), 3380 ms at the 233 GFLOP/s OpenBLAS's
# SkylakeX core reached in its one-thread calibration, leaving <= 1390 ms (29%). A run
# whose non-GEMM share is above LIMIT is flagged, and no ratio against it is fair.
# Keys: (family, n_layer, n_embd, seq, batch, threads, compute) of the PyTorch run (a run without
# "family", from before Llama, is GPT-2's); values:
# (healthy non-GEMM share, LIMIT). Configs without an entry print their breakdown only;
# add one when a quiet run has measured the healthy share there.
#
# Llama ~125M (configs/llama-125m.toml), B=4, T=256, Zen 5 VM, 2026-12-02, no other load: with
# GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (the default since then, torch_blas.blas_env) PyTorch spent
# 33-38% (one thread, 127-160 tok/s, 4 runs) and 36-45% (two, 213-244 tok/s, 4 runs) of its step
# outside the GEMMs; without it, 58% and 53% (76.9 and 132.5 tok/s, 403K and 434K page faults per
# step). (GPT-2's one-thread share was 33-38% in the same runs.)
PYTORCH_NON_GEMM_LIMITS = {
    ("gpt2", 12, 768, 256, 4, 1, "f32"): (0.30, 0.50),
    ("llama", 12, 768, 256, 4, 1, "f32"): (0.35, 0.50),
    ("llama", 12, 768, 256, 4, 2, "f32"): (0.40, 0.50),
}


def _non_gemm_limit(d):
    key = (d.get("family", "gpt2"),) + tuple(d.get(k) for k in ("n_layer", "n_embd", "seq", "batch", "threads",
                                                                 "compute"))
    return PYTORCH_NON_GEMM_LIMITS.get(key)


def pytorch_breakdown(d, top=4):
    """'GEMM 3380 ms (71%), other 1390 ms (29%) [log_softmax_backward 300, ...]' of a PyTorch run, or None."""
    if not d or d.get("failed") or d.get("gemm_ms") is None:
        return None
    share = d["gemm_share"]
    tops = ", ".join(f"{name.replace('aten::', '')} {ms:.0f}" for name, ms in (d.get("other_top") or [])[:top])
    faults = d.get("minor_faults_per_step")
    return (f"GEMM {d['gemm_ms']:.0f} ms ({100 * share:.0f}%), other {d['other_ms']:.0f} ms ({100 * (1 - share):.0f}%)"
            + (f" [top: {tops}]" if tops else "")
            + (f"; {faults / 1e3:.0f}K page faults/step" if faults is not None else ""))


def pytorch_unfair(d):
    """(non-GEMM share, healthy share, limit) when a PyTorch run's non-GEMM share is above its
    config's limit (PYTORCH_NON_GEMM_LIMITS), else None."""
    if not d or d.get("failed") or d.get("gemm_share") is None:
        return None
    limit = _non_gemm_limit(d)
    share = 1 - d["gemm_share"]
    return (share, limit[0], limit[1]) if limit and share > limit[1] else None


def pytorch_unfair_line(d, ratio=None):
    """The warning line for an unfair PyTorch run (pytorch_unfair), or None."""
    u = pytorch_unfair(d)
    if not u:
        return None
    share, healthy, limit = u
    return (f"! PyTorch spent {100 * share:.0f}% of its step outside the GEMMs, above the {100 * limit:.0f}% limit for "
            f"this config (a healthy run: ~{100 * healthy:.0f}%; bench/rows.py): a slow reference, so the ratio"
            + (f" {ratio:.2f}" if ratio else "") + " against this run is not a fair comparison")


def flops_per_token(d):
    """A run's model FLOPs per token: its own field, else model_flops_per_sec / tokens_per_sec; None if failed."""
    if not d or d.get("failed"):
        return None
    if d.get("flops_per_token"):
        return d["flops_per_token"]
    return d["model_flops_per_sec"] / d["tokens_per_sec"] if d.get("model_flops_per_sec") and d.get("tokens_per_sec") else None


def models_differ_line(lattice, pytorch, rel_tol=1e-4):
    """A warning line when the two sides of a row count different FLOPs per token (6N + 12·L·C·T: a different
    N, L, C or T means a different model), else None. rel_tol covers the rounding of a derived figure."""
    a, b = flops_per_token(lattice), flops_per_token(pytorch)
    if a is None or b is None or abs(a - b) <= rel_tol * max(a, b):
        return None
    return (f"! lattice counts {a / 1e6:.3f} MFLOP per token and PyTorch {b / 1e6:.3f}: the two sides did not build "
            "the same model, so their ratio is not a comparison")
