#!/usr/bin/python3
"""`lattice train` with a mixture-of-experts GPT-2, written again in PyTorch
from docs/moe.md: an independent reference for lattice's MoE layer and its
training.

Run:
    /usr/bin/python3 tools/moe_reference.py -c run.toml [--set k=v ...] --out DIR
        [--compare-metrics lattice/metrics.jsonl --compare-checkpoint lattice/ckpt] [--tol NAME=VALUE]
    /usr/bin/python3 tools/moe_reference.py --selftest

Everything that is not the MoE layer is tools/torch_train_reference.py's
(imported, not copied): the TOML config and `--set`, lattice's seeded init
(Philox4x32-10 keyed by (train.seed, FNV-1a of the HF name), element i of
lattice's [out, in] tensor), the llm.c shards and lattice's shuffled sampler,
warm-up + cosine lr, clip_grad_norm_, torch.optim.AdamW (foreach=False) with
decay on the tensors of dim >= 2, the metrics and checkpoint comparison.

The model: GPT-2 (LayerNorm eps 1e-5, learned positions, tanh-GELU, tied
head; biases in every linear layer unless model.bias = false), layer l's MLP
replaced by an MoE layer when model.n_experts > 0 and (l + 1) % moe_every == 0.
On an MoE layer, with X [N, C] the rows of ln_2's output (N = B*T of one
data-parallel rank's micro-batch, row r = b*T + t):

    logits = X @ W_g^T                  W_g = h.L.mlp.router.weight [E, C]; f32
    p      = softmax(logits)            [N, E]
    score  = p + b                      b = h.L.mlp.router.expert_bias [E] (a buffer, f32)
    choice = the first k of torch.sort(score, descending, stable): the k largest,
             ties to the lower expert index
    w_j    = p_{e_j} / sum_j' p_{e_j'}  (k >= 2: renormalised over the k chosen)
           = p_{e_1}                    (k = 1)
    capacity (moe.capacity_factor = cf > 0): cap = ceil(N*k*cf/E) (double
             arithmetic, left to right); an expert with more pairs keeps the
             cap of highest p_{t,e} (ties: the earlier row kept); a dropped
             pair contributes nothing and the others' w are not renormalised
    y_t    = sum over kept pairs (t, j) of w_j * Expert_{e_j}(x_t)  (+ Shared(x_t))
             Expert_e(x) = GELU_tanh(x W1^T + b1) W2^T + b2 (the bias b2 is inside,
             times w); Shared = one such MLP n_shared_experts * moe_ffn_hidden wide
    f_i    = (pairs routed to i, before dropping) / (N*k)       (a constant)
    P_i    = (1/N) sum_t p_{t,i}
    L_aux  = alpha * E * sum_i f_i P_i                           (moe.aux_loss_coef)
    L_z    = beta * (1/N) sum_t logsumexp(logits_t)^2            (moe.z_loss_coef)

Each rank's micro-batch backpropagates (CE + sum over MoE layers of (L_aux +
L_z)) / (A * dp) (A = train.grad_accum_steps): a data-parallel run is
replayed rank by rank (each rank's rows are its own N; the CE alone would
not care). After each optimizer step, per MoE layer, with load_i the pairs
routed to expert i (before dropping) over the whole step and every rank:
b_i <- fl32(b_i + fl32(u) * sign(mean(load) - load_i)), the sign decided
on integers (sum(load) - E*load_i). b is not a parameter: no gradient, no
AdamW, no weight decay, not in the grad norm; it is saved in model.safetensors.

Per step the metrics add to torch_train_reference's: aux_loss and z_loss
(the mean over MoE layers of each layer's L_aux / L_z, averaged over the
step's micro-batches and ranks like the loss), expert_load_min /
expert_load_max (over every MoE layer and expert, of the pairs routed to that
expert of that layer before dropping, summed over the step's micro-batches and
ranks: the loads the bias update uses) and dropped_fraction (dropped pairs /
routed pairs, all MoE layers, the whole step); and, the tool's own,
expert_load (those loads, [MoE layer][expert]) and routing_margin (the smallest gap the step's discrete
decisions had: score_(k) - score_(k+1) of any row, and, at capacity, the p of
an expert's last kept pair minus its first dropped pair's: a decision that
close could go the other way under another summation order).

Initialisation (lattice's draw, torch_train_reference.init_spec with the MoE
layers' entries): router [E, C] N(0, 0.02) (stored as drawn: not Conv1D),
experts' c_fc [F, C] N(0, 0.02), c_proj [C, F] N(0, 0.02/sqrt(2 n_layer))
(drawn in that [out, in] layout, stored transposed: Conv1D), biases 0; the
shared experts the same with width n_shared*F; expert_bias 0 (or
checkpoint.init_from's, when the file has it).

precision.compute must be f32 (the MoE layer's bf16 roundings are not
specified yet). float64 (--dtype float64) only measures what f32 rounding
does, for the tolerances.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_reference as ref  # noqa: E402
import safetensors_lite  # noqa: E402
import torch_train_reference as ttr  # noqa: E402

ConfigError = ttr.ConfigError


# ---- configuration -------------------------------------------------------------

class Shape:
    """The model's shape and the MoE settings from a config dict (ttr.load_config's)."""

    def __init__(self, cfg):
        self.L, self.H, self.C = cfg["model.n_layer"], cfg["model.n_head"], cfg["model.n_embd"]
        self.V, self.T = cfg["model.vocab_size"], cfg["model.seq_len"]
        self.bias = cfg["model.bias"]
        self.F = cfg["model.ffn_hidden"] or 4 * self.C            # the dense MLP's width
        self.E, self.k = cfg["model.n_experts"], cfg["model.top_k"]
        self.every, self.S = cfg["model.moe_every"], cfg["model.n_shared_experts"]
        self.Fe = cfg["model.moe_ffn_hidden"] or self.F            # 0: the model's MLP width
        self.alpha, self.beta = cfg["moe.aux_loss_coef"], cfg["moe.z_loss_coef"]
        self.u, self.cf = cfg["moe.bias_update_rate"], cfg["moe.capacity_factor"]

    def is_moe(self, l):
        return self.E > 0 and (l + 1) % self.every == 0


def load_config(path=None, overrides=()):
    cfg = ttr.load_config(path, overrides, moe=True)
    s = Shape(cfg)

    def refuse(cond, msg):
        if cond:
            raise ConfigError(msg)
    refuse(cfg["precision.compute"] != "f32", f"precision.compute={cfg['precision.compute']!r}: this reference "
           "trains MoE models in f32 only (the MoE layer's bf16 roundings are not specified)")
    refuse(s.E < 0, f"model.n_experts={s.E} must be >= 0")
    if s.E:
        refuse(not 1 <= s.k <= s.E, f"model.top_k={s.k} must be in 1..model.n_experts={s.E}")
        refuse(s.every < 1, f"model.moe_every={s.every} must be >= 1")
        refuse(s.S < 0 or s.Fe < 0, "model.n_shared_experts and model.moe_ffn_hidden must be >= 0")
        for key in ("moe.aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate", "moe.capacity_factor"):
            refuse(cfg[key] < 0, f"{key}={cfg[key]} must be >= 0")
    return cfg


def capacity(N, k, cf, E):
    """ceil(N*k*cf/E) in double arithmetic, left to right (cf = 0: no limit)."""
    return math.ceil(N * k * cf / E) if cf > 0 else None


# ---- the model ------------------------------------------------------------------

class Linear(nn.Module):
    """HF Conv1D (weight [in, out], y = x @ W + b) whose bias may be absent; with
    a bias it is gpt2_reference.Conv1D's arithmetic (addmm)."""

    def __init__(self, n_in, n_out, bias, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(self.bias, x2, self.weight) if self.bias is not None else x2 @ self.weight
        return y.view(x.shape[:-1] + (self.weight.shape[1],))


class GeluMLP(nn.Module):
    """GPT-2's MLP, width F: c_proj(GELU_tanh(c_fc(x))) (gpt2_reference.MLP's arithmetic)."""

    def __init__(self, C, F_, bias, dtype):
        super().__init__()
        self.c_fc = Linear(C, F_, bias, dtype)
        self.c_proj = Linear(F_, C, bias, dtype)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Router(nn.Module):
    def __init__(self, E, C, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, C, dtype=dtype))     # [E, C], lattice's and HF's layout
        self.register_buffer("expert_bias", torch.zeros(E, dtype=dtype))  # the selection bias b


class Routing:
    """One MoE layer's decisions and statistics on one micro-batch."""
    __slots__ = ("logits", "p", "chosen", "w", "keep", "counts", "kept", "aux", "z", "margin")


class MoE(nn.Module):
    """docs/moe.md's layer on rows X [N, C]; forward returns (y [N, C], Routing)."""

    def __init__(self, s, dtype):
        super().__init__()
        self.E, self.k, self.alpha, self.beta, self.cf = s.E, s.k, s.alpha, s.beta, s.cf
        self.router = Router(s.E, s.C, dtype)
        self.experts = nn.ModuleList([GeluMLP(s.C, s.Fe, s.bias, dtype) for _ in range(s.E)])
        self.shared_experts = GeluMLP(s.C, s.S * s.Fe, s.bias, dtype) if s.S else None

    def route(self, X):
        E, k = self.E, self.k
        N = X.shape[0]
        r = Routing()
        r.logits = X @ self.router.weight.t()                          # [N, E]
        r.p = F.softmax(r.logits, dim=-1)
        score = r.p.detach() + self.router.expert_bias                 # selects only: no gradient
        vals, order = torch.sort(score, dim=-1, descending=True, stable=True)
        r.chosen = order[:, :k]                                        # [N, k], ties: lower index first
        margin = float((vals[:, k - 1] - vals[:, k]).min()) if k < E else math.inf
        pc = r.p.gather(1, r.chosen)
        r.w = pc / pc.sum(dim=1, keepdim=True) if k >= 2 else pc
        r.counts = torch.bincount(r.chosen.reshape(-1), minlength=E)  # routed pairs, before dropping
        r.keep = torch.ones(N, k, dtype=torch.bool)
        cap = capacity(N, k, self.cf, E)
        if cap is not None:
            pd = r.p.detach()
            for e in range(E):
                t_idx, j_idx = (r.chosen == e).nonzero(as_tuple=True)   # in row order
                if t_idx.numel() <= cap:
                    continue
                pe = pd[t_idx, e]
                by_p = torch.sort(pe, descending=True, stable=True).indices  # ties: the earlier row first
                drop = by_p[cap:]
                r.keep[t_idx[drop], j_idx[drop]] = False
                margin = min(margin, float(pe[by_p[cap - 1]] - pe[by_p[cap]]))
        r.kept = int(r.keep.sum())
        r.margin = margin
        f = r.counts.to(r.p.dtype) / (N * k)                           # a count: no gradient
        r.aux = self.alpha * E * (f * r.p.mean(dim=0)).sum()
        r.z = self.beta * (torch.logsumexp(r.logits, dim=-1) ** 2).mean()
        return r

    def forward(self, X):
        r = self.route(X)
        y = torch.zeros_like(X)
        for e, expert in enumerate(self.experts):
            t_idx, j_idx = ((r.chosen == e) & r.keep).nonzero(as_tuple=True)
            if t_idx.numel():
                y = y.index_add(0, t_idx, expert(X.index_select(0, t_idx)) * r.w[t_idx, j_idx].unsqueeze(1))
        if self.shared_experts is not None:
            y = y + self.shared_experts(X)
        return y, r


class Block(nn.Module):
    def __init__(self, s, l, dtype):
        super().__init__()
        self.ln_1 = ref.LayerNorm(s.C, dtype)
        self.attn = ref.Attention(ref.GPT2Config(s.L, s.H, s.C, s.V, s.T), dtype)
        self.attn.c_attn = Linear(s.C, 3 * s.C, s.bias, dtype)
        self.attn.c_proj = Linear(s.C, s.C, s.bias, dtype)
        self.ln_2 = ref.LayerNorm(s.C, dtype)
        self.moe = s.is_moe(l)
        self.mlp = MoE(s, dtype) if self.moe else GeluMLP(s.C, s.F, s.bias, dtype)

    def forward(self, x, routings):
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        if not self.moe:
            return x + self.mlp(h)
        y, r = self.mlp(h.reshape(-1, h.shape[-1]))
        routings.append(r)
        return x + y.view(h.shape)


class Model(nn.Module):
    """GPT-2 with MoE layers; named_parameters() are the HF names (docs/moe.md),
    named_buffers() the selection biases h.L.mlp.router.expert_bias."""

    def __init__(self, s, dtype=torch.float32):
        super().__init__()
        self.shape = s
        self.cfg = ref.GPT2Config(s.L, s.H, s.C, s.V, s.T)
        self.wte = nn.Embedding(s.V, s.C, dtype=dtype)
        self.wpe = nn.Embedding(s.T, s.C, dtype=dtype)
        self.h = nn.ModuleList([Block(s, l, dtype) for l in range(s.L)])
        self.ln_f = ref.LayerNorm(s.C, dtype)

    def moe_layers(self):
        return [b.mlp for b in self.h if b.moe]

    def forward(self, idx):
        """idx int64 [B, T] -> (logits [B, T, V], [Routing of each MoE layer])."""
        routings = []
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x, routings)
        return self.ln_f(x) @ self.wte.weight.t(), routings


def objective(model, inputs, targets):
    """(cross-entropy, CE + sum over MoE layers of (L_aux + L_z), routings)."""
    logits, routings = model(inputs)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    obj = ce
    for r in routings:
        obj = obj + (r.aux + r.z)
    return ce, obj, routings


def init_spec(cfg):
    """torch_train_reference.init_spec with this model's MLPs (dense or MoE)."""
    s = Shape(cfg)

    def gelu_mlp(prefix, width):
        out = [(prefix + "c_fc.weight", (width, s.C), "normal", True), (prefix + "c_fc.bias", (width,), "zeros", False),
               (prefix + "c_proj.weight", (s.C, width), "proj", True), (prefix + "c_proj.bias", (s.C,), "zeros", False)]
        return [e for e in out if s.bias or not e[0].endswith(".bias")]

    def mlp(l, h):
        if not s.is_moe(l):
            return gelu_mlp(h + "mlp.", s.F)
        out = [(h + "mlp.router.weight", (s.E, s.C), "normal", False)]
        for e in range(s.E):
            out += gelu_mlp(f"{h}mlp.experts.{e}.", s.Fe)
        if s.S:
            out += gelu_mlp(h + "mlp.shared_experts.", s.S * s.Fe)
        return out
    return ttr.init_spec(cfg, bias=s.bias, mlp=mlp)


def state_tensors(model):
    """{HF name: tensor}: the parameters and the selection biases."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update({n: b.detach() for n, b in model.named_buffers()})
    return out


@torch.no_grad()
def load_state(model, tensors):
    """Copies {HF name: tensor} in; every parameter must be there, a selection
    bias may be missing (0), other names are ignored."""
    tensors = ref.strip_prefix(tensors)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors]
    if missing:
        raise KeyError(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for name, t in list(params.items()) + list(model.named_buffers()):
        if name not in tensors:
            t.zero_()
            continue
        if tuple(tensors[name].shape) != tuple(t.shape):
            raise ValueError(f"{name}: shape {list(tensors[name].shape)} in the file, the model's is {list(t.shape)}")
        t.copy_(tensors[name].to(t.dtype))


def build_model(cfg, dtype=torch.float32):
    """The model at its initial values: checkpoint.init_from's, else lattice's seeded draw."""
    model = Model(Shape(cfg), dtype)
    load_state(model, ttr.initial_state(cfg, init_spec(cfg)))
    return model


@torch.no_grad()
def update_bias(b, load, u):
    """DeepSeek-V3's selection-bias step: b_i += u * sign(mean(load) - load_i),
    the sign decided on the integer loads, the add rounded once in b's dtype."""
    load = [int(x) for x in load]
    total, E = sum(load), len(load)
    sign = torch.tensor([(total > E * x) - (total < E * x) for x in load], dtype=b.dtype)
    b.add_(sign * torch.tensor(u, dtype=b.dtype))


# ---- training --------------------------------------------------------------------

def train(cfg, threads=1, log=None, dtype=torch.float32):
    """torch_train_reference.train's recipe with the MoE objective, statistics
    and selection-bias updates; returns the same dict ("steps", "model",
    "optimizer", "init", "sampler")."""
    torch.set_num_threads(threads)
    model = build_model(cfg, dtype)
    init = {k: v.clone() for k, v in state_tensors(model).items()}
    named = list(model.named_parameters())
    params = [p for _, p in named]
    groups = [{"params": [p for n, p in named if ttr.decayed(n, p)], "weight_decay": cfg["optim.weight_decay"]},
              {"params": [p for n, p in named if not ttr.decayed(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg["optim.lr"], betas=(cfg["optim.beta1"], cfg["optim.beta2"]),
                            eps=cfg["optim.eps"], foreach=False)
    A, dp, mbs = cfg["train.grad_accum_steps"], cfg["parallel.dp"], cfg["train.micro_batch_size"]
    sampler = ttr.Sampler(cfg["data.train"], cfg["model.seq_len"], dp * mbs * A, A, cfg["train.seed"],
                          cfg["model.vocab_size"])
    moe = model.moe_layers()
    s_ = model.shape
    clip, u = cfg["optim.grad_clip"], cfg["moe.bias_update_rate"]
    steps = []
    for s in range(cfg["train.steps"]):
        lr = ttr.lr_at(s, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        seqs, micro = sampler.next_step()
        epoch = sampler.epoch
        micro_losses, aux, z, margin = [], 0.0, 0.0, math.inf
        load = torch.zeros(len(moe), max(s_.E, 1), dtype=torch.int64)
        kept = 0
        for inputs, targets in micro:
            ce_sum = 0.0
            for r in range(dp):  # each data-parallel rank's rows are their own micro-batch
                rows = slice(r * mbs, (r + 1) * mbs)
                ce, obj, routings = objective(model, inputs[rows], targets[rows])
                (obj / (A * dp) if dp > 1 else obj / A).backward()
                ce_sum += ce.item()
                for i, rt in enumerate(routings):
                    load[i] += rt.counts
                    kept += rt.kept
                    margin = min(margin, rt.margin)
                if routings:
                    aux += sum(rt.aux.item() for rt in routings) / len(routings)
                    z += sum(rt.z.item() for rt in routings) / len(routings)
            micro_losses.append(ce_sum / dp if dp > 1 else ce_sum)
        for p in params:  # an expert no token reached this step: a zero gradient, still an AdamW step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm, scale = ttr.clip_gradients(params, clip)
        opt.step()
        if u > 0:
            for layer, l_load in zip(moe, load):
                update_bias(layer.router.expert_bias, l_load, u)
        rec = {"step": s + 1, "loss": sum(micro_losses) / A, "lr": lr, "grad_norm": norm, "clip_scale": scale,
               "micro_losses": micro_losses, "epoch": epoch, "sequences": [int(i) for i in seqs]}
        if moe:
            routed = int(load.sum())
            rec.update({"aux_loss": aux / (A * dp), "z_loss": z / (A * dp),
                        "expert_load_min": int(load.min()), "expert_load_max": int(load.max()),
                        "dropped_fraction": (routed - kept) / routed, "expert_load": load.tolist(),
                        "routing_margin": margin})
        steps.append(rec)
        if log:
            extra = (f" | aux {rec['aux_loss']:.5f} | z {rec['z_loss']:.5f} | experts "
                     f"{rec['expert_load_min']}..{rec['expert_load_max']} | dropped "
                     f"{rec['dropped_fraction']:.3f}") if moe else ""
            log(f"step {s + 1:3d} | loss {rec['loss']:.6f} | lr {lr:.3e} | norm {norm:.4f}"
                f"{' (clipped)' if scale < 1 else ''}{extra}")
    return {"steps": steps, "model": model, "optimizer": opt, "init": init, "sampler": sampler}


def write_outputs(result, cfg, out_dir):
    """metrics.jsonl, init.safetensors, model.safetensors (with the selection
    biases) and optimizer.safetensors, as lattice's checkpoints name them."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for rec in result["steps"]:
            f.write(json.dumps(rec) + "\n")
    meta = {"format": "pt", "n_head": cfg["model.n_head"]}
    safetensors_lite.save_torch(os.path.join(out_dir, "init.safetensors"), result["init"], meta)
    safetensors_lite.save_torch(os.path.join(out_dir, "model.safetensors"), state_tensors(result["model"]), meta)
    safetensors_lite.save_torch(os.path.join(out_dir, "optimizer.safetensors"),
                                ttr.moments(result["model"], result["optimizer"]))


# ---- comparing a lattice run -------------------------------------------------------

# torch_train_reference's f32 tolerances (loss, lr, grad norms, parameters,
# moments; measured for this tool in tools/README.md) and the MoE's own:
#   aux_rtol / z_rtol   every step's aux_loss / z_loss, relative
#   dropped_atol        every step's dropped_fraction
#   expert_load_min / _max and every expert_bias are held exactly: they
#   follow from discrete decisions (and the bias from u-sized f32 steps).
MOE_TOLERANCES = {"aux_rtol": 1e-4, "z_rtol": 1e-4, "dropped_atol": 1e-6}
DEFAULT_TOLERANCES = dict(ttr.DEFAULT_TOLERANCES["f32"], **MOE_TOLERANCES)


def compare(result, cfg, metrics_path=None, ckpt_path=None, tol=None):
    """torch_train_reference.compare (losses, lr, grad norms, parameters, Adam
    moments), then the MoE metrics of every step and the selection biases."""
    tol = dict(DEFAULT_TOLERANCES, **(tol or {}))
    rep = ttr.compare(result, cfg, metrics_path, ckpt_path, tol)
    fail = rep["failures"].append
    moe = result["model"].moe_layers()
    if metrics_path and moe:
        lat = ttr.read_metrics(metrics_path)
        worst = {"aux_loss": 0.0, "z_loss": 0.0, "dropped_fraction": 0.0}
        for rec in result["steps"]:
            k = rec["step"]
            if k not in lat:
                continue  # ttr.compare has said so
            missing = [key for key in ("aux_loss", "z_loss", "expert_load_min", "expert_load_max",
                                       "dropped_fraction") if key not in lat[k]]
            if missing:
                fail(f"metrics: step {k} of {metrics_path} has no {', '.join(missing)}")
                continue
            for key, t in (("aux_loss", "aux_rtol"), ("z_loss", "z_rtol")):
                theirs, ours = float(lat[k][key]), rec[key]
                d = ttr._rel(theirs, ours) if ours != 0 else abs(theirs)
                worst[key] = max(worst[key], d)
                if tol.get(t) is not None and not d <= tol[t]:
                    fail(f"step {k}: {key} lattice {theirs:.9g} torch {ours:.9g}, relative {d:.3e} > {t} {tol[t]:g}")
            d = abs(float(lat[k]["dropped_fraction"]) - rec["dropped_fraction"])
            worst["dropped_fraction"] = max(worst["dropped_fraction"], d)
            if tol.get("dropped_atol") is not None and not d <= tol["dropped_atol"]:
                fail(f"step {k}: dropped_fraction lattice {lat[k]['dropped_fraction']} torch "
                     f"{rec['dropped_fraction']:.9g}")
            for key in ("expert_load_min", "expert_load_max"):
                if int(lat[k][key]) != rec[key]:
                    fail(f"step {k}: {key} lattice {lat[k][key]} torch {rec[key]}")
        rep["moe_max_diff"] = worst
    if ckpt_path and moe:
        d = ttr.checkpoint_dir(ckpt_path)
        lat_p, _ = safetensors_lite.load_torch(os.path.join(d, "model.safetensors"))
        rep["expert_bias"] = {}
        for name, b in result["model"].named_buffers():
            if name not in lat_p or tuple(lat_p[name].shape) != tuple(b.shape):
                fail(f"{name}: missing or of another shape in {d}")
                continue
            diff = float((lat_p[name].to(torch.float64) - b.to(torch.float64)).abs().max())
            rep["expert_bias"][name] = diff
            if diff != 0:
                fail(f"{name}: lattice {lat_p[name].tolist()} torch {b.tolist()} (held exactly)")
    return rep


SUMMARY_KEYS = ttr.SUMMARY_KEYS + ("moe_max_diff", "expert_bias")


# ---- selftest ---------------------------------------------------------------------

def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _numpy_moe(X, Wg, b, experts, shared, k, cf, alpha, beta):
    """docs/moe.md's layer in float64 numpy, a token and a choice at a time.
    experts / shared: (W1 [C, F], b1 or None, W2 [F, C], b2 or None), HF layout.
    Returns (y, chosen, keep, counts, aux, z)."""
    N, C = X.shape
    E = Wg.shape[0]

    def mlp(x, m):
        W1, b1, W2, b2 = m
        h = _gelu(x @ W1 + (b1 if b1 is not None else 0.0))
        return h @ W2 + (b2 if b2 is not None else 0.0)
    p = np.zeros((N, E))
    lse = np.zeros(N)
    chosen, w = [], []
    for t in range(N):
        logits = np.array([sum(X[t, c] * Wg[e, c] for c in range(C)) for e in range(E)])
        m = logits.max()
        ex = np.exp(logits - m)
        p[t] = ex / ex.sum()
        lse[t] = m + math.log(ex.sum())
        score = p[t] + b
        picks = []
        for _ in range(k):  # the largest score not yet taken; ties: the lower index
            best = None
            for e in range(E):
                if e not in picks and (best is None or score[e] > score[best]):
                    best = e
            picks.append(best)
        chosen.append(picks)
        total = sum(p[t, e] for e in picks)
        w.append([p[t, e] / total if k >= 2 else p[t, e] for e in picks])
    keep = [[True] * k for _ in range(N)]
    counts = np.zeros(E, dtype=np.int64)
    for t in range(N):
        for e in chosen[t]:
            counts[e] += 1
    if cf > 0:
        cap = math.ceil(N * k * cf / E)
        for e in range(E):
            pairs = sorted(((p[t, e], t, j) for t in range(N) for j in range(k) if chosen[t][j] == e),
                           key=lambda q: (-q[0], q[1]))
            for _, t, j in pairs[cap:]:
                keep[t][j] = False
    y = np.zeros((N, C))
    for t in range(N):
        for j in range(k):
            if keep[t][j]:
                y[t] += w[t][j] * mlp(X[t], experts[chosen[t][j]])
        if shared is not None:
            y[t] += mlp(X[t], shared)
    f = counts / (N * k)
    aux = alpha * E * sum(f[i] * p[:, i].mean() for i in range(E))
    z = beta * np.mean(lse ** 2)
    return y, np.array(chosen), np.array(keep), counts, aux, z


def _shape(**kw):
    """A Shape for a lone MoE layer (selftest)."""
    s = Shape.__new__(Shape)
    s.L, s.H, s.V, s.T, s.F, s.every = 1, 1, 1, 1, 0, 1
    s.C, s.E, s.k, s.S = kw.get("C", 6), kw["E"], kw["k"], kw.get("S", 0)
    s.Fe, s.bias = kw.get("Fe", 5), kw.get("bias", True)
    s.alpha, s.beta, s.u, s.cf = kw.get("alpha", 0.01), kw.get("beta", 0.0), 0.0, kw.get("cf", 0.0)
    return s


def _random_layer(s, seed, router_std=1.0):
    layer = MoE(s, torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (router_std if "router" in n else 0.5))
    return layer


def _numpy_of(layer, X):
    def m(mod):
        if mod is None:
            return None
        return tuple(None if t is None else t.detach().numpy() for t in
                     (mod.c_fc.weight, mod.c_fc.bias, mod.c_proj.weight, mod.c_proj.bias))
    return _numpy_moe(X.detach().numpy(), layer.router.weight.detach().numpy(),
                      layer.router.expert_bias.numpy(), [m(e) for e in layer.experts], m(layer.shared_experts),
                      layer.k, layer.cf, layer.alpha, layer.beta)


def _check_layer(s, seed, bias=None, N=12, fd_points=3):
    """The torch layer against the numpy loop (forward, decisions, losses), and
    its autograd gradients of sum(y*G) + L_aux + L_z, and of L_aux + L_z alone,
    against central differences (float64, routing held: checked)."""
    layer = _random_layer(s, seed)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(N, s.C, generator=g, dtype=torch.float64, requires_grad=True)
    G = torch.randn(N, s.C, generator=g, dtype=torch.float64)
    if bias is not None:
        layer.router.expert_bias.copy_(torch.tensor(bias, dtype=torch.float64))
    y, r = layer(X)
    ny, nchosen, nkeep, ncounts, naux, nz = _numpy_of(layer, X)
    assert (r.chosen.numpy() == nchosen).all(), (r.chosen, nchosen)
    assert (r.keep.numpy() == nkeep).all(), (r.keep, nkeep)
    assert (r.counts.numpy() == ncounts).all()
    err = float(np.abs(y.detach().numpy() - ny).max() / np.abs(ny).max())
    assert err < 1e-12, f"forward differs from the numpy loop by {err:.2e}"
    assert abs(r.aux.item() - naux) <= 1e-12 * abs(naux) and abs(r.z.item() - nz) <= 1e-12 * max(abs(nz), 1e-300)
    assert r.margin > 1e-5, f"seed {seed}: a near-tie ({r.margin:.1e}); finite differences would cross it"
    dropped = int((~r.keep).sum())

    tensors = [("X", X)] + list(layer.named_parameters())
    for what, fn in (("sum(y*G) + aux + z", lambda y, r: (y * G).sum() + r.aux + r.z),
                     ("aux + z", lambda y, r: r.aux + r.z)):
        for _, t in tensors:
            t.grad = None
        fn(*layer(X)).backward()
        grads = {n: (t.grad.clone() if t.grad is not None else torch.zeros_like(t)) for n, t in tensors}
        gi = torch.Generator().manual_seed(seed + 2)
        for n, t in tensors:
            for i in torch.randint(0, t.numel(), (fd_points,), generator=gi).tolist():
                vals = []
                for h in (1e-6, -1e-6):
                    with torch.no_grad():
                        t.view(-1)[i] += h
                        y2, r2 = layer(X)
                        vals.append(float(fn(y2, r2)))
                        t.view(-1)[i] -= h
                    assert torch.equal(r2.chosen, r.chosen) and torch.equal(r2.keep, r.keep), "routing moved"
                fd = (vals[0] - vals[1]) / 2e-6
                ag = float(grads[n].view(-1)[i])
                assert abs(fd - ag) <= 1e-7 + 1e-6 * abs(ag), f"{what}: d/d{n}[{i}] autograd {ag:.10g} vs FD {fd:.10g}"
    return dropped


def _write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = ttr.SHARD_MAGIC, ttr.SHARD_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def selftest():
    torch.set_num_threads(1)
    notes = []
    # The layer against the numpy loop and finite differences: k = 2 with a
    # selection bias and shared experts; k = 1 (Switch weights) with capacity
    # drops; k = 3 of 3; experts without biases; capacity with k = 2.
    d1 = _check_layer(_shape(E=4, k=2, S=1, alpha=0.3, beta=0.2), seed=1, bias=[0.05, -0.1, 0.0, 0.2])
    d2 = _check_layer(_shape(E=4, k=1, cf=1.0, alpha=0.3, beta=0.2), seed=2)
    _check_layer(_shape(E=3, k=3, alpha=0.3, beta=0.2, bias=False), seed=3)
    d4 = _check_layer(_shape(E=4, k=2, cf=0.75, S=2, alpha=0.1, beta=0.05), seed=4, bias=[0.0, 0.1, 0.0, -0.1])
    assert d1 == 0 and d2 > 0 and d4 > 0, (d1, d2, d4)
    notes.append(f"layer = numpy loop, gradients = finite differences ({d2} + {d4} pairs dropped by capacity)")

    # Identities. Router weight 0: p = 1/E, so L_aux = alpha whatever f is; the
    # ties pick experts 0..k-1 (the stable sort's lower index first); z = beta*log(E)^2.
    for E, k in ((8, 2), (4, 1), (6, 3)):
        layer = _random_layer(_shape(E=E, k=k, alpha=0.01, beta=0.001), seed=5)
        with torch.no_grad():
            layer.router.weight.zero_()
        r = layer.route(torch.randn(16, 6, dtype=torch.float64))
        assert (r.chosen == torch.arange(k)).all(), r.chosen
        assert abs(r.aux.item() - 0.01) < 1e-15 and abs(r.z.item() - 0.001 * math.log(E) ** 2) < 1e-15
    # Uniform f and P by symmetry: rows x and -x, E = 2, k = 1: each row to the other expert.
    layer = _random_layer(_shape(E=2, k=1, alpha=0.01), seed=6)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0, 0, 0], [-1.0, 0, 0, 0, 0, 0]]))
    X = torch.randn(8, 6, dtype=torch.float64)
    X[:, 0] = X[:, 0].abs() + 0.1
    r = layer.route(torch.cat([X, -X]))
    assert r.counts.tolist() == [8, 8] and abs(r.aux.item() - 0.01) < 1e-15, (r.counts, r.aux)
    # Collapse: k = 1, every row to expert 0 with p ~ 1 - 3e-22: L_aux = alpha*E.
    layer = _random_layer(_shape(E=4, k=1, alpha=0.01), seed=7)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 50.0
    X = torch.randn(16, 6, dtype=torch.float64)
    X[:, 0] = 1.0
    r = layer.route(X)
    assert r.counts.tolist() == [16, 0, 0, 0] and abs(r.aux.item() - 0.04) < 1e-15, (r.counts, r.aux)
    # z-loss: beta * mean(logsumexp^2), against numpy.
    layer = _random_layer(_shape(E=5, k=2, beta=0.3), seed=8)
    X = torch.randn(10, 6, dtype=torch.float64)
    r = layer.route(X)
    lg = X.numpy() @ layer.router.weight.detach().numpy().T
    want = 0.3 * np.mean(np.log(np.exp(lg).sum(1)) ** 2)
    assert abs(r.z.item() - want) < 1e-13 * want
    notes.append("aux = alpha at uniform routing and alpha*E at collapse; z = beta*mean(lse^2)")

    # Capacity: ceil(N*k*cf/E), the lowest p dropped, ties: the later row dropped.
    cases = ((64, 2, 1.0, 4), (10, 1, 1.0, 4), (64, 2, 1.25, 8), (64, 2, 1.1, 4), (8, 1, 0.5, 2), (5, 2, 0.0, 4))
    assert [capacity(*a) for a in cases] == [32, 3, 20, 36, 2, None]
    layer = _random_layer(_shape(E=2, k=1, cf=0.5), seed=9)  # N = 8: cap 2
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0
    X = torch.zeros(8, 6, dtype=torch.float64)
    X[:, 0] = torch.tensor([0.5, 2.0, 1.0, 2.0, 3.0, -1.0, 0.25, -2.0])  # rows 0,1,2,3,4,6 to expert 0
    r = layer.route(X)
    assert r.counts.tolist() == [6, 2]
    # expert 0 keeps row 4 (p highest) and row 1 (tied with row 3: the earlier kept); expert 1 keeps both
    assert r.keep[:, 0].tolist() == [False, True, False, False, True, True, False, True], r.keep[:, 0]
    assert r.margin == 0.0  # the tie is a zero margin
    notes.append("capacity drops the lowest p, the later row on ties")

    # Selection-bias step: sign(mean(load) - load_i), integers; the add in f32.
    b = torch.tensor([0.1, 0.0, -0.3, 0.7], dtype=torch.float32)
    update_bias(b, [5, 3, 3, 1], 1e-3)
    u32 = np.float32(1e-3)
    want = np.array([np.float32(0.1) - u32, np.float32(0.0), np.float32(-0.3), np.float32(0.7) + u32], np.float32)
    assert (b.numpy().view(np.uint32) == want.view(np.uint32)).all(), (b, want)
    update_bias(b, [2, 2, 2, 2], 1e-3)
    assert (b.numpy().view(np.uint32) == want.view(np.uint32)).all()
    update_bias(b, [3, 2, 2, 2], 0.5)  # mean 2.25: only expert 0 is above it
    assert b.tolist() == [float(np.float32(want[0] - 0.5)), 0.5, float(np.float32(want[2] + 0.5)),
                          float(np.float32(want[3] + 0.5))], b
    notes.append("bias update sign rule")

    # The model: init, names, and whole-run identities on a small shard.
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(3)
        _write_shard(os.path.join(d, "train_000000.bin"), rng.integers(0, 64, 12 * 17 + 1))
        base = ["model.n_layer=2", "model.n_head=2", "model.n_embd=16", "model.vocab_size=64", "model.seq_len=16",
                "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.steps=3", "optim.lr=1e-2",
                "optim.warmup_steps=1", f"data.train={d}/train_*.bin", "train.seed=11"]
        # n_experts = 0 is torch_train_reference's GPT-2 to the last bit.
        cfg = load_config(None, base)
        a, b_ = train(cfg), ttr.train(ttr.load_config(None, base))
        assert [r["loss"] for r in a["steps"]] == [r["loss"] for r in b_["steps"]]
        sa, sb = state_tensors(a["model"]), ref.state_tensors(b_["model"])
        assert sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)
        # Init: lattice's draw of each MoE tensor in its [out, in] layout; the dense tensors are ttr's.
        moe = base + ["model.n_experts=4", "model.top_k=2", "model.moe_every=2", "model.n_shared_experts=2",
                      "model.moe_ffn_hidden=12", "moe.z_loss_coef=0.001"]
        cfg = load_config(None, moe)
        init = state_tensors(build_model(cfg))
        dense = ttr.lattice_init(ttr.load_config(None, base))
        names = set(init)
        want = set(dense) - {"h.1.mlp.c_fc.weight", "h.1.mlp.c_fc.bias", "h.1.mlp.c_proj.weight", "h.1.mlp.c_proj.bias"}
        want |= {"h.1.mlp.router.weight", "h.1.mlp.router.expert_bias"}
        want |= {f"h.1.mlp.{e}.{w}.{x}" for e in ["experts.0", "experts.1", "experts.2", "experts.3", "shared_experts"]
                 for w in ("c_fc", "c_proj") for x in ("weight", "bias")}
        assert names == want, names ^ want
        for n in set(dense) & names:
            assert torch.equal(init[n], torch.from_numpy(dense[n])), n
        std_proj = np.float32(np.float32(0.02) / np.sqrt(np.float32(4)))
        def draw(name, shape, std):  # lattice's [out, in] tensor
            return ttr.init_normal(11, name, shape[0] * shape[1]).reshape(shape) * std
        std_w = np.float32(0.02)
        draws = {"h.1.mlp.router.weight": draw("h.1.mlp.router.weight", (4, 16), std_w),  # not transposed
                 "h.1.mlp.experts.2.c_fc.weight": draw("h.1.mlp.experts.2.c_fc.weight", (12, 16), std_w).T,
                 "h.1.mlp.experts.3.c_proj.weight": draw("h.1.mlp.experts.3.c_proj.weight", (16, 12), std_proj).T,
                 "h.1.mlp.shared_experts.c_fc.weight": draw("h.1.mlp.shared_experts.c_fc.weight", (24, 16), std_w).T}
        for n, x in draws.items():
            assert init[n].shape == x.shape and torch.equal(init[n], torch.from_numpy(np.ascontiguousarray(x))), n
        assert not init["h.1.mlp.experts.0.c_fc.bias"].any() and not init["h.1.mlp.router.expert_bias"].any()
        nb = state_tensors(build_model(load_config(None, moe + ["model.bias=false"])))
        linear_bias = lambda n: n.endswith(".bias") and "ln_" not in n  # noqa: E731
        assert set(nb) == {n for n in names if not linear_bias(n)}, sorted(nb)
        notes.append("init = lattice's draw in [out, in], HF names and layouts")

        # One expert, top-1: w = softmax of one logit = 1, so the model is the dense
        # one with that expert's weights, the router gets no gradient (aux is alpha).
        one = load_config(None, base + ["model.n_experts=1", "model.top_k=1", "moe.aux_loss_coef=0.01"])
        m1, m0 = build_model(one), build_model(load_config(None, base))
        with torch.no_grad():
            for n, p in m1.named_parameters():
                if ".experts.0." in n:
                    p.copy_(dict(m0.named_parameters())[n.replace("experts.0.", "")])
        tok = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        ce1, obj1, rts = objective(m1, tok[:, :-1], tok[:, 1:])
        ce0 = objective(m0, tok[:, :-1], tok[:, 1:])[0]
        assert ce1.item() == ce0.item() and abs(obj1.item() - ce0.item() - 0.02) < 1e-6, (ce1, ce0, obj1)
        obj1.backward()
        assert not m1.h[0].mlp.router.weight.grad.any()

        # The whole objective's gradient (float64, every layer MoE, k = 2, aux, z,
        # bias, capacity, shared) against finite differences of the model.
        full = load_config(None, base + ["model.n_experts=4", "model.top_k=2", "model.n_shared_experts=1",
                                         "moe.aux_loss_coef=0.5", "moe.z_loss_coef=0.3", "moe.capacity_factor=1.0",
                                         "model.moe_ffn_hidden=8"])
        m = build_model(full, torch.float64)
        with torch.no_grad():
            for blk in m.h:
                blk.mlp.router.weight.mul_(50.0)  # decisive routing: finite differences must not move it
                blk.mlp.router.expert_bias.copy_(torch.tensor([0.0, 0.01, -0.01, 0.0]))
        x, y = tok[:, :-1], tok[:, 1:]
        _, obj, rts = objective(m, x, y)
        obj.backward()
        assert sum(int((~r.keep).sum()) for r in rts) > 0 and min(r.margin for r in rts) > 1e-6
        gi = torch.Generator().manual_seed(2)
        for n in ("h.0.mlp.router.weight", "h.1.mlp.router.weight", "h.0.mlp.experts.1.c_fc.weight",
                  "h.1.mlp.experts.3.c_proj.bias", "h.1.mlp.shared_experts.c_fc.weight", "h.0.attn.c_attn.weight",
                  "wte.weight"):
            p = dict(m.named_parameters())[n]
            for i in torch.randint(0, p.numel(), (2,), generator=gi).tolist():
                vals = []
                for h in (1e-6, -1e-6):
                    with torch.no_grad():
                        p.view(-1)[i] += h
                        _, o, r2 = objective(m, x, y)
                        p.view(-1)[i] -= h
                    assert all(torch.equal(a.chosen, b.chosen) and torch.equal(a.keep, b.keep) for a, b in zip(r2, rts))
                    vals.append(o.item())
                fd, ag = (vals[0] - vals[1]) / 2e-6, float(p.grad.view(-1)[i])
                assert abs(fd - ag) <= 1e-7 + 1e-6 * abs(ag), f"model: d/d{n}[{i}] autograd {ag:.10g} vs FD {fd:.10g}"
        notes.append("one expert top-1 = dense; the model's gradient = finite differences")

        # A short MoE run: the bias moves by u per step, the metrics add up, the
        # files hold the selection biases.
        cfg = load_config(None, moe + ["moe.bias_update_rate=0.001", "moe.capacity_factor=1.0", "parallel.dp=2",
                                       "train.micro_batch_size=1"])
        res = train(cfg)
        for rec in res["steps"]:
            assert sum(map(sum, rec["expert_load"])) == 2 * 2 * 16 * 2  # 1 MoE layer: A*dp*N*k pairs
            assert rec["expert_load_min"] == min(rec["expert_load"][0]) and rec["aux_loss"] > 0
        b = res["model"].h[1].mlp.router.expert_bias
        assert b.abs().max() > 0 and all(abs(v / 1e-3 - round(v / 1e-3)) < 1e-3 for v in b.tolist()), b
        write_outputs(res, cfg, d)
        saved, _ = safetensors_lite.load_torch(os.path.join(d, "model.safetensors"))
        assert torch.equal(saved["h.1.mlp.router.expert_bias"], b)
        notes.append("bias updates and outputs")
    return "selftest ok: " + "; ".join(notes)


# ---- command line --------------------------------------------------------------------

def main(argv=None):
    def dtype_option(ap):
        ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64 only measures what f32 rounding does (tolerances)")
    return ttr.run_command_line(
        "moe_reference", __doc__, argv, selftest=selftest, load=load_config,
        train=lambda cfg, args: train(cfg, args.threads, None if args.quiet else print, getattr(torch, args.dtype)),
        write=write_outputs, compare=compare, tolerance_names=list(DEFAULT_TOLERANCES), summary_keys=SUMMARY_KEYS,
        extra_options=dtype_option)


if __name__ == "__main__":
    sys.exit(main())
