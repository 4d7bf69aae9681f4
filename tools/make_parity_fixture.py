#!/usr/bin/python3
"""Writes the GPT-2 parity fixture that lattice's model/optimizer test replays.

Run:  /usr/bin/python3 tools/make_parity_fixture.py [--out tests/model/fixtures]

Everything is deterministic (seeded torch.Generator, 1 thread, fp32).

Model: n_layer=2, n_head=4, n_embd=32, vocab_size=101 (not a multiple of 128
on purpose), n_positions (lattice: model.seq_len) = 16.  B=4, T=16.

One training run of 10 steps with grad_accum_steps=2.  Every step uses the same
two micro-batches: tokens[0] then tokens[1] (each [B, T+1]); micro-batch m has
inputs = tokens[m][:, :-1], targets = tokens[m][:, 1:].  Each micro-batch's
mean cross-entropy (over its B*T positions) is divided by 2 before backward,
so the accumulated gradient is the gradient of the mean of the two losses.
The step's reported loss = (loss_mb0 + loss_mb1) / 2, measured in the forward
pass of that step, i.e. with the parameters *before* the step's update.

Optimizer (torch.optim.AdamW, foreach=False, amsgrad=False):
  lr(s), s = 0..steps-1 the index of the step being taken:
      s < warmup:  max_lr * (s+1) / warmup
      else:        d = (s - warmup) / (steps - warmup)
                   min_lr + 0.5 * (1 + cos(pi * d)) * (max_lr - min_lr)
  betas (0.9, 0.95), eps 1e-8, weight_decay 0.1 (decoupled: p *= 1 - lr*wd)
  only on tensors with dim >= 2 (wte, wpe, linear weights); biases and
  LayerNorm parameters have weight_decay 0.
  Before the optimizer: global grad-norm clipping, max_norm 1.0
  (torch.nn.utils.clip_grad_norm_: norm = ||all grads||_2 with the tied wte
  gradient counted once; grads *= max_norm / (norm + 1e-6) when that is < 1).

Files (all fp32 unless said, HF GPT-2 names and layouts, no lm_head):
  init.safetensors         parameters before step 0
  batch.safetensors        "tokens": F32 [2, B, T+1], exact integers in [0, V)
                           (stored as float so the C++ reader needs float dtypes only)
  grads_step1.safetensors  accumulated gradient of the FIRST step (s = 0),
                           before clipping (= d mean(loss_mb0, loss_mb1) / d param)
  final.safetensors        parameters after all 10 steps
  expected.json            config, recipe, and per step: loss, micro-batch
                           losses, grad_norm (pre-clip), clip scale, lr;
                           loss_after_final: the losses with final.safetensors
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_reference as ref  # noqa: E402
import safetensors_lite  # noqa: E402

CONFIG = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=101, n_positions=16)
B, T = 4, 16
GRAD_ACCUM = 2
STEPS, WARMUP = 10, 3
MAX_LR, MIN_LR = 1e-2, 1e-3
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1
GRAD_CLIP = 1.0
PARAM_SEED, TOKEN_SEED = 0, 1


def lr_at(s):
    if s < WARMUP:
        return MAX_LR * (s + 1) / WARMUP
    decay_ratio = (s - WARMUP) / (STEPS - WARMUP)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (MAX_LR - MIN_LR)


def make_tokens():
    g = torch.Generator().manual_seed(TOKEN_SEED)
    return torch.randint(0, CONFIG["vocab_size"], (GRAD_ACCUM, B, T + 1), generator=g, dtype=torch.int64)


def run(dtype, tokens, out_dir=None):
    """Trains STEPS steps; writes files when out_dir is given.
    Returns (record, model, gradients of the first step)."""
    cfg = ref.GPT2Config(**CONFIG)
    model = ref.build_model(cfg, dtype)
    ref.init_params(model, seed=PARAM_SEED)
    return train(model, ref, tokens, out_dir, "parity fixture")


def train(model, reference, tokens, out_dir, what):
    """The recipe on `model` (any reference module's: its save_safetensors,
    is_decayed and forward_loss), from its initial values: STEPS AdamW steps of
    GRAD_ACCUM micro-batches, clipped. Writes init, first-step gradients and
    final parameters to out_dir when given; `what` names the fixture in their
    metadata. Returns (record, model, gradients of the first step)."""
    ref = reference
    if out_dir:
        ref.save_safetensors(model, os.path.join(out_dir, "init.safetensors"),
                             {"what": f"{what}: parameters before step 0"})

    decay = [p for n, p in model.named_parameters() if ref.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not ref.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=MAX_LR, betas=BETAS, eps=EPS, foreach=False, amsgrad=False)

    rec = {"loss": [], "micro_losses": [], "grad_norm": [], "clip_scale": [], "clipped": [], "lr": []}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        micro = []
        for m in range(GRAD_ACCUM):
            x, y = tokens[m][:, :-1], tokens[m][:, 1:]
            loss = ref.forward_loss(model, x, y)
            (loss / GRAD_ACCUM).backward()
            micro.append(loss.item())
        if s == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            if out_dir:
                ref.save_safetensors(model, os.path.join(out_dir, "grads_step1.safetensors"),
                                     {"what": "accumulated gradient of the first step (s=0), before clipping"},
                                     grads=True)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item()
        scale = GRAD_CLIP / (norm + 1e-6)
        lr = lr_at(s)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        rec["loss"].append(sum(micro) / GRAD_ACCUM)
        rec["micro_losses"].append(micro)
        rec["grad_norm"].append(norm)
        rec["clip_scale"].append(min(scale, 1.0))
        rec["clipped"].append(scale < 1.0)
        rec["lr"].append(lr)
    with torch.no_grad():
        rec["final_micro_losses"] = [ref.forward_loss(model, tokens[m][:, :-1], tokens[m][:, 1:]).item()
                                     for m in range(GRAD_ACCUM)]
    if out_dir:
        ref.save_safetensors(model, os.path.join(out_dir, "final.safetensors"),
                             {"what": f"{what}: parameters after {STEPS} steps"})
    return rec, model, first_grads


def compare(a, b):
    """Per tensor: max |a-b| and ||a-b|| / ||b||, with c_attn.bias split into Q|K|V."""
    out = {}
    for n in b:
        parts = [(n, slice(None))]
        if n.endswith("attn.c_attn.bias"):
            C = b[n].shape[0] // 3
            parts = [(n + f"[{q}]", slice(i * C, (i + 1) * C)) for i, q in enumerate("QKV")]
        for label, sl in parts:
            x, y = a[n][sl].double(), b[n][sl].double()
            d = (x - y).abs()
            out[label] = {"max_abs": d.max().item(), "rel_l2": (d.norm() / y.norm()).item(),
                          "max_abs_ref": y.abs().max().item()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "tests", "model", "fixtures"))
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokens = make_tokens()
    safetensors_lite.save_numpy(os.path.join(out, "batch.safetensors"),
                                {"tokens": tokens.to(torch.float32).numpy()},
                                {"what": "tokens [grad_accum=2, B, T+1] as exact integers in F32; "
                                         "micro-batch m: inputs tokens[m][:, :-1], targets tokens[m][:, 1:]"})

    rec, model, grads = run(torch.float32, tokens, out)

    # The same run in float64 says how much of fp32 is rounding noise: a C++
    # fp32 implementation cannot be expected to match this file closer than that.
    # The K third of c_attn.bias has an exactly zero gradient in exact arithmetic
    # (softmax is invariant to q.b_k, the same for every key), so in fp32 its
    # gradient is rounding noise that Adam turns into updates of up to ~lr*g/eps.
    # Compare that slice with an absolute tolerance (see this section's numbers).
    rec64, model64, grads64 = run(torch.float64, tokens)
    final_cmp = compare(dict(model.named_parameters()), dict(model64.named_parameters()))
    grads_cmp = compare(grads, grads64)
    fp64_check = {
        "note": "the same run in float64: how far fp32 rounding alone moves things. c_attn.bias[K] "
                "has zero true gradient; its fp32 gradient is noise and Adam amplifies it",
        "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(rec["loss"], rec64["loss"])),
        "max_rel_grad_norm_diff": max(abs(a - b) / abs(b) for a, b in zip(rec["grad_norm"], rec64["grad_norm"])),
        "loss_fp64": rec64["loss"],
        "grad_norm_fp64": rec64["grad_norm"],
        "final_params": final_cmp,
        "grads_first_step": grads_cmp,
    }

    expected = {
        "description": "lattice GPT-2 parity fixture; made by tools/make_parity_fixture.py (read its docstring)",
        "torch_version": torch.__version__,
        "model": {"n_layer": CONFIG["n_layer"], "n_head": CONFIG["n_head"], "n_embd": CONFIG["n_embd"],
                  "vocab_size": CONFIG["vocab_size"], "seq_len": CONFIG["n_positions"]},
        "train": {"micro_batch_size": B, "seq_len": T, "grad_accum_steps": GRAD_ACCUM, "steps": STEPS,
                  "same_batch_every_step": True, "dtype": "float32"},
        "optim": {"name": "AdamW (torch.optim.AdamW, foreach=False)", "lr": MAX_LR, "min_lr": MIN_LR,
                  "warmup_steps": WARMUP, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
                  "weight_decay": WEIGHT_DECAY, "weight_decay_applies_to": "tensors with dim >= 2",
                  "grad_clip": GRAD_CLIP, "clip_formula": "scale = grad_clip / (norm + 1e-6), applied if < 1",
                  "lr_schedule": "s<warmup: lr*(s+1)/warmup; else min_lr + 0.5*(1+cos(pi*(s-warmup)/(steps-warmup)))*(lr-min_lr)"},
        "init": {"seed": PARAM_SEED, "weights": "N(0, 0.02)", "ln_weight": "1 + 0.1*N(0,1)",
                 "biases": "0.02*N(0,1)"},
        "tokens": {"seed": TOKEN_SEED, "file": "batch.safetensors", "name": "tokens",
                   "dtype": "F32 (exact integers)", "shape": [GRAD_ACCUM, B, T + 1]},
        "loss_definition": "per step: mean over the 2 micro-batches of mean cross-entropy over B*T positions, "
                           "computed before that step's update",
        "grad_norm_definition": "global L2 norm of the accumulated gradient before clipping (tied wte counted once)",
        "files": {"init": "init.safetensors", "batch": "batch.safetensors",
                  "grads_first_step": "grads_step1.safetensors", "final": "final.safetensors"},
        "steps": [{"step": s, "lr": rec["lr"][s], "loss": rec["loss"][s], "micro_losses": rec["micro_losses"][s],
                   "grad_norm": rec["grad_norm"][s], "clip_scale": rec["clip_scale"][s],
                   "clipped": rec["clipped"][s]} for s in range(STEPS)],
        "loss": rec["loss"],
        "loss_after_final": {"micro_losses": rec["final_micro_losses"],
                             "loss": sum(rec["final_micro_losses"]) / GRAD_ACCUM,
                             "definition": "losses of the two micro-batches with final.safetensors (no update)"},
        "grad_norm": rec["grad_norm"],
        "lr": rec["lr"],
        "fp32_vs_fp64_same_run": fp64_check,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")

    for s in range(STEPS):
        print(f"step {s}: lr {rec['lr'][s]:.6e} loss {rec['loss'][s]:.9f} "
              f"grad_norm {rec['grad_norm'][s]:.6f} {'clipped' if rec['clipped'][s] else ''}")
    print(f"fp32 vs fp64: max rel loss diff {fp64_check['max_rel_loss_diff']:.2e}, "
          f"max rel grad norm diff {fp64_check['max_rel_grad_norm_diff']:.2e}")
    for what, cmp in (("grads_step1", grads_cmp), ("final", final_cmp)):
        for label, c in cmp.items():
            print(f"  {what:11s} {label:28s} max_abs {c['max_abs']:.2e} rel_l2 {c['rel_l2']:.2e} "
                  f"(max |ref| {c['max_abs_ref']:.2e})")
    for name in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, name)):8d}  {os.path.join(out, name)}")


if __name__ == "__main__":
    main()
