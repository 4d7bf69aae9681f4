#!/usr/bin/python3
"""Writes the Llama parity fixtures that lattice's model/optimizer test replays.

Run:  /usr/bin/python3 tools/make_llama_parity_fixture.py [--out tests/model/fixtures]

Writes OUT/llama_kv4/, OUT/llama_kv2/, OUT/llama_kv1/: the same tiny Llama
(tools/llama_reference.py) with 4, 2 and 1 key/value heads (multi-head,
grouped-query, multi-query attention). Deterministic (seeded
torch.Generator, 1 thread, fp32): a second run writes the same bytes.

Model: n_layer=2, n_head=4, n_embd=32 (head size 8), vocab_size=101 (not a
multiple of 128: lattice pads), max_position_embeddings (lattice: seq_len)=16,
intermediate_size (ffn_hidden)=64, rope_theta=10000, rms_norm_eps=1e-5,
untied lm_head, no biases.

Init (torch.Generator seed 0, one N(0,1) draw per parameter in HF's
named_parameters() order): every weight of dim >= 2 (embed_tokens, the
projections, lm_head) 0.02·N; every RMSNorm weight 1.0.

The run is make_parity_fixture.py's recipe exactly (its constants and
batches are imported from it): B=4, T=16, grad_accum_steps=2 with the same
two micro-batches every step (tokens[0] then tokens[1], each [B, T+1],
inputs [:, :-1], targets [:, 1:], each micro-batch's mean CE / 2 before
backward), 10 steps; global grad-norm clipping at 1.0 (scale 1/(norm+1e-6)
when < 1; lm_head and embed_tokens are separate tensors, each counted);
torch.optim.AdamW(foreach=False), betas (0.9, 0.95), eps 1e-8, weight decay
0.1 on tensors with dim >= 2 (embed_tokens, lm_head, projections) and 0 on
the RMSNorm weights; lr for step s: max_lr·(s+1)/3 for s < 3, else
min_lr + ½(1+cos(π(s−3)/7))·(max_lr−min_lr), max_lr 1e-2, min_lr 1e-3.

Files in each directory (F32, HF Llama names and layouts):
  init.safetensors         parameters before step 0
  batch.safetensors        "tokens" F32 [2, B, T+1], exact integers in [0, 101)
                           (the same batch as tests/model/fixtures/)
  grads_step1.safetensors  the first step's accumulated gradient, before clipping
  final.safetensors        parameters after the 10 steps
  config.json              the HF LlamaConfig of the model (llama_reference.py reads it)
  expected.json            "model": the config as lattice's model keys (family
                           "llama", n_kv_head, ffn_hidden, rope_theta, norm_eps,
                           norm, mlp, position, bias, tie_embeddings, ...);
                           "train", "optim", per-step loss, micro_losses,
                           grad_norm (pre-clip), clip_scale, clipped, lr;
                           loss_after_final (final.safetensors, no update);
                           fp32_vs_fp64_same_run (the same run in float64:
                           how far fp32 rounding alone moves each number).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference as ref  # noqa: E402
import make_parity_fixture as recipe  # noqa: E402  (the GPT-2 fixture's recipe and batches)
import safetensors_lite  # noqa: E402

BASE = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=101, max_positions=16, ffn_hidden=64,
            rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, attention_bias=False, mlp_bias=False)
KV_HEADS = (4, 2, 1)
PARAM_SEED = 0


def config_of(n_kv_head):
    return ref.LlamaConfig(**BASE, n_kv_head=n_kv_head)


def lattice_model_keys(cfg):
    """The model section in lattice's config keys (src/lattice/model/config.h)."""
    return {"family": "llama", "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
            "vocab_size": cfg.vocab_size, "seq_len": cfg.max_positions, "n_kv_head": cfg.n_kv_head,
            "ffn_hidden": cfg.ffn_hidden, "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps,
            "norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": cfg.attention_bias or cfg.mlp_bias,
            "tie_embeddings": cfg.tie_embeddings}


def run(cfg, dtype, tokens, out_dir=None):
    """Trains recipe.STEPS steps; writes the safetensors files when out_dir is given.
    Returns (record, model, gradients of the first step)."""
    model = ref.build_model(cfg, dtype)
    ref.init_params(model, seed=PARAM_SEED)
    if out_dir:
        ref.save_safetensors(model, os.path.join(out_dir, "init.safetensors"),
                             {"what": "llama parity fixture: parameters before step 0"})

    decay = [p for n, p in model.named_parameters() if ref.is_decayed(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not ref.is_decayed(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.MAX_LR, betas=recipe.BETAS, eps=recipe.EPS, foreach=False, amsgrad=False)

    A = recipe.GRAD_ACCUM
    rec = {"loss": [], "micro_losses": [], "grad_norm": [], "clip_scale": [], "clipped": [], "lr": []}
    for s in range(recipe.STEPS):
        opt.zero_grad(set_to_none=True)
        micro = []
        for m in range(A):
            loss = ref.forward_loss(model, tokens[m][:, :-1], tokens[m][:, 1:])
            (loss / A).backward()
            micro.append(loss.item())
        if s == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            if out_dir:
                ref.save_safetensors(model, os.path.join(out_dir, "grads_step1.safetensors"),
                                     {"what": "accumulated gradient of the first step (s=0), before clipping"},
                                     grads=True)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.GRAD_CLIP).item()
        scale = recipe.GRAD_CLIP / (norm + 1e-6)
        lr = recipe.lr_at(s)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        rec["loss"].append(sum(micro) / A)
        rec["micro_losses"].append(micro)
        rec["grad_norm"].append(norm)
        rec["clip_scale"].append(min(scale, 1.0))
        rec["clipped"].append(scale < 1.0)
        rec["lr"].append(lr)
    with torch.no_grad():
        rec["final_micro_losses"] = [ref.forward_loss(model, tokens[m][:, :-1], tokens[m][:, 1:]).item()
                                     for m in range(A)]
    if out_dir:
        ref.save_safetensors(model, os.path.join(out_dir, "final.safetensors"),
                             {"what": f"llama parity fixture: parameters after {recipe.STEPS} steps"})
    return rec, model, first_grads


def compare(a, b):
    """Per tensor: max |a-b|, ||a-b|| / ||b|| and max |b|."""
    out = {}
    for n in b:
        x, y = a[n].double(), b[n].double()
        d = (x - y).abs()
        out[n] = {"max_abs": d.max().item(), "rel_l2": (d.norm() / y.norm()).item(),
                  "max_abs_ref": y.abs().max().item()}
    return out


def write_fixture(out, n_kv_head, tokens):
    os.makedirs(out, exist_ok=True)
    cfg = config_of(n_kv_head)
    safetensors_lite.save_numpy(os.path.join(out, "batch.safetensors"),
                                {"tokens": tokens.to(torch.float32).numpy()},
                                {"what": "tokens [grad_accum=2, B, T+1] as exact integers in F32; "
                                         "micro-batch m: inputs tokens[m][:, :-1], targets tokens[m][:, 1:]"})
    ref.write_config(cfg, os.path.join(out, "config.json"))
    rec, model, grads = run(cfg, torch.float32, tokens, out)

    # The same run in float64 (RoPE angles still f32, as HF computes them):
    # how far fp32 rounding alone moves each number, i.e. how close a correct
    # fp32 implementation can be expected to come to these files.
    rec64, model64, grads64 = run(cfg, torch.float64, tokens)
    final_cmp = compare(dict(model.named_parameters()), dict(model64.named_parameters()))
    grads_cmp = compare(grads, grads64)
    fp64_check = {
        "note": "the same run in float64: how far fp32 rounding alone moves things",
        "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(rec["loss"], rec64["loss"])),
        "max_rel_grad_norm_diff": max(abs(a - b) / abs(b) for a, b in zip(rec["grad_norm"], rec64["grad_norm"])),
        "max_abs_grads_first_step": max(c["max_abs"] for c in grads_cmp.values()),
        "max_abs_final_params": max(c["max_abs"] for c in final_cmp.values()),
        "loss_fp64": rec64["loss"],
        "grad_norm_fp64": rec64["grad_norm"],
        "final_params": final_cmp,
        "grads_first_step": grads_cmp,
    }
    A, B, T, STEPS = recipe.GRAD_ACCUM, recipe.B, recipe.T, recipe.STEPS
    expected = {
        "description": f"lattice Llama parity fixture ({n_kv_head} key/value heads of {cfg.n_head}); "
                       "made by tools/make_llama_parity_fixture.py (read its docstring)",
        "torch_version": torch.__version__,
        "model": lattice_model_keys(cfg),
        "hf_config": "config.json",
        "train": {"micro_batch_size": B, "seq_len": T, "grad_accum_steps": A, "steps": STEPS,
                  "same_batch_every_step": True, "dtype": "float32"},
        "optim": {"name": "AdamW (torch.optim.AdamW, foreach=False)", "lr": recipe.MAX_LR, "min_lr": recipe.MIN_LR,
                  "warmup_steps": recipe.WARMUP, "beta1": recipe.BETAS[0], "beta2": recipe.BETAS[1],
                  "eps": recipe.EPS, "weight_decay": recipe.WEIGHT_DECAY,
                  "weight_decay_applies_to": "tensors with dim >= 2", "grad_clip": recipe.GRAD_CLIP,
                  "clip_formula": "scale = grad_clip / (norm + 1e-6), applied if < 1",
                  "lr_schedule": "s<warmup: lr*(s+1)/warmup; else min_lr + "
                                 "0.5*(1+cos(pi*(s-warmup)/(steps-warmup)))*(lr-min_lr)"},
        "init": {"seed": PARAM_SEED, "weights": "N(0, 0.02) (every tensor of dim >= 2)", "norm_weight": "1.0",
                 "draw_order": "one N(0,1) draw per parameter in HF named_parameters() order"},
        "tokens": {"seed": recipe.TOKEN_SEED, "file": "batch.safetensors", "name": "tokens",
                   "dtype": "F32 (exact integers)", "shape": [A, B, T + 1]},
        "loss_definition": "per step: mean over the 2 micro-batches of mean cross-entropy over B*T positions, "
                           "computed before that step's update",
        "grad_norm_definition": "global L2 norm of the accumulated gradient before clipping "
                                "(embed_tokens and lm_head both counted: untied)",
        "files": {"init": "init.safetensors", "batch": "batch.safetensors",
                  "grads_first_step": "grads_step1.safetensors", "final": "final.safetensors"},
        "steps": [{"step": s, "lr": rec["lr"][s], "loss": rec["loss"][s], "micro_losses": rec["micro_losses"][s],
                   "grad_norm": rec["grad_norm"][s], "clip_scale": rec["clip_scale"][s],
                   "clipped": rec["clipped"][s]} for s in range(STEPS)],
        "loss": rec["loss"],
        "loss_after_final": {"micro_losses": rec["final_micro_losses"],
                             "loss": sum(rec["final_micro_losses"]) / A,
                             "definition": "losses of the two micro-batches with final.safetensors (no update)"},
        "grad_norm": rec["grad_norm"],
        "lr": rec["lr"],
        "fp32_vs_fp64_same_run": fp64_check,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")

    print(f"== {out}")
    for s in range(STEPS):
        print(f"step {s}: lr {rec['lr'][s]:.6e} loss {rec['loss'][s]:.9f} "
              f"grad_norm {rec['grad_norm'][s]:.6f} {'clipped' if rec['clipped'][s] else ''}")
    print(f"loss after final: {expected['loss_after_final']['loss']:.9f}")
    print(f"fp32 vs fp64: max rel loss diff {fp64_check['max_rel_loss_diff']:.2e}, "
          f"max rel grad norm diff {fp64_check['max_rel_grad_norm_diff']:.2e}, "
          f"max abs first-step grad diff {fp64_check['max_abs_grads_first_step']:.2e}, "
          f"max abs final param diff {fp64_check['max_abs_final_params']:.2e}")
    for name in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, name)):8d}  {os.path.join(out, name)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "tests", "model", "fixtures"),
                    help="the parent of the llama_kv* directories")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokens = recipe.make_tokens()
    for kv in KV_HEADS:
        write_fixture(os.path.join(os.path.normpath(args.out), f"llama_kv{kv}"), kv, tokens)


if __name__ == "__main__":
    main()
