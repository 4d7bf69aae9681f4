#!/usr/bin/python3
"""PyTorch CPU Llama training-step benchmark: the reference lattice's Llama is compared with.

    /usr/bin/python3 bench/torch_llama_bench.py --config configs/llama-125m.toml \\
        --batch 4 --seq 256 --threads 2 --steps 5 --warmup 2

The model is tools/llama_reference.py's (Hugging Face LlamaForCausalLM, eager
attention: RMSNorm, rotary positions by rotate-half, grouped-query attention
by repeat_kv, SwiGLU MLP, tied or untied head), fp32. Everything else is
bench/torch_gpt2_bench.py's driver, imported, not copied (its docstring): one
step = forward + backward + AdamW (lr 6e-4, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 on tensors of dim >= 2), no clipping, one fixed random
batch; PyTorch on OpenBLAS with the core type bench/torch_blas.py picks,
OMP_WAIT_POLICY=PASSIVE, the refusals (BLAS, core, threads, GEMM rate), the
threads observed, one profiled step (GEMM and non-GEMM time) and the same
JSON fields, with "family": "llama" and the Llama shape keys added
(n_kv_head, ffn_hidden, tie_embeddings, rope_theta, norm_eps, bias).

The shape. --config FILE reads the [model] table of a lattice TOML config
(configs/llama-125m.toml), so both sides of bench/compare_gpt2.sh take the
model from one file; a key the file leaves out takes lattice's Llama default
(ModelConfig::defaults(Family::Llama) and ModelConfig::ffn in
src/lattice/model/config.*): n_layer 12, n_head 12, n_embd 768, vocab_size
50257, n_kv_head = n_head, ffn_hidden = 8C/3 rounded up to a multiple of 256,
rope_theta 10000, norm_eps 1e-5, no biases, tie_embeddings false (a key set to
"" is left out, as lattice reads it; docs/config.md). The flags
(--n-layer, --n-head, --n-embd, --vocab, --n-kv-head, --ffn-hidden,
--tie-embeddings) override the file. model.seq_len (lattice's longest
sequence) is not read: --seq is the trained length, and the compare script
sets lattice's model.seq_len to it. A file whose family is not "llama", or
whose part keys (norm, mlp, position) are not Llama's, is refused.

Model FLOPs per token: 6N + 12·L·C·T (lattice's ModelConfig::flops_per_token),
N = the parameters that are multiplied: all but the token embedding when the
head is untied (then the embedding is a lookup and lm_head the product); tied,
the one matrix counted once. At configs/llama-125m.toml (tied) N = 121,191,936
and at T = 256 that is 755.5 MFLOP per token.
"""

import argparse
import os
import sys
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_blas  # noqa: E402
import torch_gpt2_bench as driver  # noqa: E402

# lattice's defaults for a Llama (ModelConfig::defaults(Family::Llama)); 0 = derived (see llama_shape).
LLAMA_DEFAULTS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "n_kv_head": 0,
                  "ffn_hidden": 0, "rope_theta": 10000.0, "norm_eps": 1e-5, "bias": False,
                  "tie_embeddings": False}
# [model] keys that must hold Llama's part, and keys this benchmark does not need.
LLAMA_PARTS = {"family": "llama", "norm": "rmsnorm", "mlp": "swiglu", "position": "rope"}
IGNORED_KEYS = {"seq_len"}
# Flag attribute -> [model] key.
FLAG_KEYS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "vocab": "vocab_size",
             "n_kv_head": "n_kv_head", "ffn_hidden": "ffn_hidden", "tie_embeddings": "tie_embeddings"}


def lattice_ffn(n_embd):
    """ModelConfig::ffn's Llama default: two thirds of 4C, rounded up to a multiple of 256."""
    return (8 * n_embd // 3 + 255) // 256 * 256


def read_model_table(path):
    """[model] of a lattice TOML config; one clear error for a missing file, bad TOML or a non-Llama model."""
    try:
        with open(path, "rb") as f:
            model = tomllib.load(f).get("model", {})
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not TOML ({e})")
    # A part key set to "" is the family's default (docs/config.md), as one left out.
    model = {k: v for k, v in model.items() if v != ""}
    for key, want in LLAMA_PARTS.items():
        got = model.get(key, "gpt2" if key == "family" else want)
        if got != want:
            raise ValueError(f"--config {path}: model.{key} = \"{got}\", but this benchmark builds a Llama "
                             f"(model.{key} = \"{want}\"; GPT-2 is bench/torch_gpt2_bench.py)")
    unknown = sorted(set(model) - set(LLAMA_DEFAULTS) - set(LLAMA_PARTS) - IGNORED_KEYS)
    if unknown:
        raise ValueError(f"--config {path}: model.{unknown[0]} is not a key this benchmark knows "
                         f"(known: {', '.join(sorted(set(LLAMA_DEFAULTS) | set(LLAMA_PARTS) | IGNORED_KEYS))})")
    return model


def llama_shape(args):
    """The model's keys: the flags, else --config's [model], else lattice's Llama defaults, derived ones filled."""
    shape = dict(LLAMA_DEFAULTS)
    if args.config:
        shape.update({k: v for k, v in read_model_table(args.config).items() if k in LLAMA_DEFAULTS})
    for attr, key in FLAG_KEYS.items():
        if getattr(args, attr) is not None:
            shape[key] = getattr(args, attr)
    if shape["n_kv_head"] == 0:
        shape["n_kv_head"] = shape["n_head"]
    if shape["ffn_hidden"] == 0:
        shape["ffn_hidden"] = lattice_ffn(shape["n_embd"])
    return shape


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    torch_blas.add_step_benchmark_args(ap)
    driver.add_driver_args(ap)
    ap.add_argument("--config", default=None, help="lattice TOML config whose [model] gives the shape")
    ap.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: the config's, else n_head)")
    ap.add_argument("--ffn-hidden", type=int, default=None,
                    help="SwiGLU hidden width (default: the config's, else 8C/3 rounded up to 256)")
    ap.add_argument("--tie-embeddings", type=lambda s: {"on": True, "off": False}[s], default=None,
                    metavar="{on,off}", help="LM head tied to the token embedding (default: the config's, else off)")
    # The shape flags default to "not given", so that --config's values stand unless a flag overrides them.
    ap.set_defaults(n_layer=None, n_head=None, n_embd=None, vocab=None)
    args = ap.parse_args()
    try:
        shape = llama_shape(args)
    except ValueError as e:
        ap.error(str(e))
    args.n_layer, args.n_head, args.n_embd, args.vocab = (shape[k] for k in ("n_layer", "n_head", "n_embd",
                                                                             "vocab_size"))
    args.llama_shape = shape
    torch_blas.check_step_benchmark_args(ap, args)
    if shape["n_kv_head"] <= 0 or shape["n_head"] % shape["n_kv_head"]:
        ap.error(f"n_kv_head {shape['n_kv_head']} must be positive and divide n_head {shape['n_head']}")
    if shape["ffn_hidden"] <= 0:
        ap.error(f"ffn_hidden must be positive, got {shape['ffn_hidden']}")
    return args


def build_llama(torch, args):
    """tools/llama_reference.py's Llama of args.llama_shape; N leaves out an untied token embedding."""
    import llama_reference as ref
    s = args.llama_shape
    cfg = ref.LlamaConfig(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"], vocab_size=s["vocab_size"],
                          max_positions=args.seq, n_kv_head=s["n_kv_head"], ffn_hidden=s["ffn_hidden"],
                          rope_theta=float(s["rope_theta"]), norm_eps=float(s["norm_eps"]),
                          tie_embeddings=bool(s["tie_embeddings"]), attention_bias=bool(s["bias"]),
                          mlp_bias=bool(s["bias"]))
    model = ref.build_model(cfg)
    ref.init_params(model, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight is one Parameter: counted once
    if not cfg.tie_embeddings:
        n_params -= model.model.embed_tokens.weight.numel()
    fields = {"family": "llama", "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
              "n_embd": cfg.n_embd, "ffn_hidden": cfg.ffn_hidden, "vocab_size": cfg.vocab_size,
              "tie_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps,
              "bias": bool(s["bias"]), "config": args.config}
    return driver.StepModel(model, ref.forward_loss, ref.is_decayed, n_params, fields)


def main():
    driver.run_step_benchmark(parse_args(), build_llama)


if __name__ == "__main__":
    main()
