#!/usr/bin/python3
"""`lattice train`'s recipe, written again in PyTorch: an independent reference
for the trainer itself.

Run:
    /usr/bin/python3 tools/torch_train_reference.py -c run.toml [--set k=v ...] --out DIR
        [--compare-metrics lattice/metrics.jsonl --compare-checkpoint lattice/ckpt]

It reads the same TOML config and `--set` overrides as `lattice train` and
trains the same model on the same data, one process, with nothing of
lattice's code:

- initial weights: `checkpoint.init_from` (HF GPT-2 safetensors), or else
  lattice's own seeded draw, recomputed here (Philox4x32-10 keyed by
  (train.seed, FNV-1a hash of the parameter name), Box-Muller; GPT-2's
  N(0, 0.02) weights, residual projections N(0, 0.02/sqrt(2 n_layer)),
  biases 0, LayerNorm weights 1);
- batches: the llm.c `.bin` shards of `data.train` (sorted file names,
  concatenated), sequence i = tokens [i*T, i*T + T + 1), S = (N-1) // T of
  them; each epoch a Fisher-Yates permutation drawn from a Philox stream
  keyed by (seed, epoch); step k of an epoch takes permutation entries
  [k*G, (k+1)*G), G = the global batch, and micro-batch a of it is entries
  [a*G/A, (a+1)*G/A) (A = micro-batches per step: the data-parallel ranks'
  rows of one micro-batch, concatenated); an epoch ends when fewer than G
  sequences are left;
- loss: mean cross-entropy over a micro-batch's tokens; the gradient of the
  mean over the A micro-batches (each backward of loss/A accumulates);
- global grad-norm clipping: torch.nn.utils.clip_grad_norm_(optim.grad_clip);
- torch.optim.AdamW (foreach=False): betas, eps, decoupled weight decay on the
  tensors with dim >= 2 (wte, wpe, the linear weights), none on biases and
  LayerNorm parameters (GPT-2 / nanoGPT);
- learning rate of step s (0-based), W = warmup_steps, S = steps:
  lr·(s+1)/W while s < W, then min_lr + ½(1 + cos(π·(s-W)/(S-W)))·(lr - min_lr);
- precision.compute = "f32": the PyTorch GPT-2 of tools/gpt2_reference.py in
  torch.float32. "bf16": the same model with lattice's bf16 semantics made
  explicit (docs/precision.md): weights rounded to bf16 for compute (f32
  masters, moments and gradients), every activation rounded to bf16 where it
  is produced, GEMM and reduction sums in f32, the logits and the loss in
  f32, and each gradient a linear layer's GEMMs read (dY) rounded to bf16
  (bias gradients sum the f32 dY). Roundings are PyTorch's bf16 conversion
  (round to nearest even); their backward passes the gradient through.

float64 is used nowhere in the model or the optimizer. What does not change
the arithmetic (parallel layout, ZeRO, threads, logging, checkpoint
directory) is ignored: any layout trains the same model. What this tool does
not replicate is refused by name (synthetic data, f16 and its loss scale,
compressed gradients, resuming; mixtures of experts, model.bias = false and
other MLP widths are tools/moe_reference.py's, which imports this file).

Writes DIR/metrics.jsonl (per step: step, loss, lr, grad_norm (before
clipping), clip_scale, micro_losses, epoch, sequences), DIR/init.safetensors,
DIR/model.safetensors and DIR/optimizer.safetensors (`NAME.exp_avg`,
`NAME.exp_avg_sq`), HF names and layouts as lattice's checkpoints. With
--compare-* it compares a lattice run against that and exits 1 on a mismatch
(tolerances per precision: DEFAULT_TOLERANCES; --tol NAME=VALUE overrides).
"""

import argparse
import glob
import json
import math
import os
import sys
import tomllib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_reference as ref  # noqa: E402
import safetensors_lite  # noqa: E402

# ---- configuration ----------------------------------------------------------

# The keys that change what is computed, with lattice's defaults (docs/config.md).
MATH_KEYS = {
    "model.n_layer": 12, "model.n_head": 12, "model.n_embd": 768, "model.vocab_size": 50257,
    "model.seq_len": 1024,
    "train.micro_batch_size": 4, "train.grad_accum_steps": 1, "train.global_batch_size": 0,
    "train.steps": 100, "train.seed": 1337,
    "optim.lr": 6e-4, "optim.min_lr": 6e-5, "optim.warmup_steps": 0, "optim.weight_decay": 0.1,
    "optim.beta1": 0.9, "optim.beta2": 0.95, "optim.eps": 1e-8, "optim.grad_clip": 1.0,
    "precision.compute": "f32",
    "parallel.dp": 1,
    "compression.grad": "none",
    "data.train": "",
    "checkpoint.init_from": "", "checkpoint.resume": "",
    # The GPT-2 family's keys: "" (the family's value) or GPT-2's own value is
    # accepted; anything else is refused in _check (this tool is GPT-2 only).
    # model.bias = false and model.ffn_hidden are for tools/moe_reference.py.
    "model.family": "gpt2", "model.bias": True, "model.ffn_hidden": 0,
    # Mixture of experts (docs/moe.md): trained by tools/moe_reference.py; this
    # tool refuses n_experts > 0.
    "model.n_experts": 0, "model.top_k": 2, "model.moe_every": 1, "model.n_shared_experts": 0,
    "model.moe_ffn_hidden": 0,
    "moe.aux_loss_coef": 0.01, "moe.z_loss_coef": 0.0, "moe.bias_update_rate": 0.0, "moe.capacity_factor": 0.0,
}
# [model] keys that select one of the family's parts: accepted at GPT-2's value
# (or "", the family's), refused otherwise.
GPT2_PARTS = {"model.norm": "layernorm", "model.mlp": "gelu", "model.position": "learned",
              "model.tie_embeddings": True, "model.norm_eps": 1e-5, "model.n_kv_head": None}
# Keys (or whole sections) that leave the arithmetic alone: accepted, ignored.
IGNORED_SECTIONS = {"zero", "log"}
IGNORED_KEYS = {
    "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.zero_stage",
    "parallel.sequence_parallel", "parallel.schedule", "parallel.virtual_stages", "parallel.partition",
    "parallel.microbatches", "parallel.bucket_mb",
    "train.eval_every", "train.eval_steps", "train.threads",
    "precision.loss_scale", "precision.loss_scale_init", "precision.loss_scale_window",
    "precision.loss_scale_backoff", "precision.loss_scale_growth", "precision.loss_scale_min",
    "compression.error_feedback", "compression.topk_ratio", "compression.rank", "compression.warmup_steps",
    "data.val", "checkpoint.dir", "checkpoint.every", "checkpoint.keep",
    "parallel.cp_mode", "model.rope_theta",  # rope_theta: learned positions have none
    "moe.token_bound",  # expert parallelism's buffer bound: the layout, not the arithmetic (assumed never hit)
    "recompute.mode", "recompute.every", "recompute.first",  # bit-identical by design
}


class ConfigError(Exception):
    pass


def _typed(key, value, origin):
    default = MATH_KEYS[key]
    try:
        if isinstance(default, bool):  # TOML true/false, or "true"/"false" from --set; "": the family's
            if value == "":
                return default
            if isinstance(value, str) and value in ("true", "false"):
                return value == "true"
            if not isinstance(value, bool):
                raise TypeError
            return value
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, str):
                value = int(value, 10)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError
            return value
        if isinstance(default, float):
            if isinstance(value, str):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError
            return float(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a {type(default).__name__}, got {value!r} ({origin})") from None


def _set(cfg, key, value, origin):
    section = key.split(".", 1)[0]
    if key in MATH_KEYS:
        cfg[key] = _typed(key, value, origin)
    elif key in GPT2_PARTS:
        cfg[key] = value  # checked in _check
    elif key not in IGNORED_KEYS and section not in IGNORED_SECTIONS:
        raise ConfigError(f"unknown key '{key}' ({origin}): not a lattice key this tool knows")


def load_config(path=None, overrides=(), moe=False):
    """The run's settings: MATH_KEYS's defaults, then the TOML file, then each
    `section.key=value` override in order (a value is typed by its key; quotes
    around a string are optional, as for `lattice train --set`). moe: the
    caller trains mixtures of experts and biasless models (tools/moe_reference.py)."""
    cfg = dict(MATH_KEYS)
    if path:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        for section, table in doc.items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file '{path}': '{section}' is not a [section]")
            for k, v in table.items():
                _set(cfg, f"{section}.{k}", v, f"config file '{path}'")
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set expects section.key=value, got '{item}'")
        key, value = item.split("=", 1)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        _set(cfg, key.strip(), value.strip(), f"from --set {item}")
    _check(cfg, moe)
    return cfg


def _gpt2_part(key, value, cfg):
    """Whether a GPT2_PARTS value is GPT-2's (or "", the family's)."""
    want = GPT2_PARTS[key]
    if value == "" or (key == "model.n_kv_head" and value in (0, "0", cfg["model.n_head"], str(cfg["model.n_head"]))):
        return True
    if isinstance(want, bool):
        return value is want or value == str(want).lower()
    if isinstance(want, float):
        try:
            return not isinstance(value, bool) and float(value) == want
        except ValueError:
            return False
    return value == want


def _check(cfg, moe=False):
    def refuse(cond, msg):
        if cond:
            raise ConfigError(msg)
    refuse(cfg["model.family"] != "gpt2",
           f"model.family={cfg['model.family']!r}: this reference trains the GPT-2 family only")
    for key in GPT2_PARTS:
        if key in cfg:
            refuse(not _gpt2_part(key, cfg[key], cfg),
                   f"{key}={cfg[key]!r}: this reference trains GPT-2's parts only")
    if not moe:
        refuse(cfg["model.n_experts"] != 0, f"model.n_experts={cfg['model.n_experts']}: a mixture of experts; "
               "tools/moe_reference.py trains those")
        refuse(not cfg["model.bias"], "model.bias=false: this tool's GPT-2 has biases; tools/moe_reference.py "
               "trains biasless GPT-2 models")
        refuse(cfg["model.ffn_hidden"] not in (0, 4 * cfg["model.n_embd"]),
               f"model.ffn_hidden={cfg['model.ffn_hidden']}: this tool's GPT-2 MLP is 4 x n_embd wide; "
               "tools/moe_reference.py trains other widths")
    refuse(cfg["precision.compute"] not in ("f32", "bf16"),
           f"precision.compute={cfg['precision.compute']!r}: this reference runs f32 and bf16 "
           "(f16's loss scale and skipped steps are not replicated)")
    refuse(cfg["compression.grad"] != "none",
           f"compression.grad={cfg['compression.grad']!r} changes the gradients; the reference has no codecs")
    refuse(not cfg["data.train"], "data.train is empty (synthetic tokens): the reference needs .bin shards")
    refuse(bool(cfg["checkpoint.resume"]), "checkpoint.resume: the reference trains from the start only")
    refuse(cfg["model.n_embd"] % cfg["model.n_head"] != 0,
           f"model.n_embd={cfg['model.n_embd']} is not divisible by model.n_head={cfg['model.n_head']}")
    refuse(cfg["optim.min_lr"] > cfg["optim.lr"],
           f"optim.min_lr={cfg['optim.min_lr']} must be <= optim.lr={cfg['optim.lr']}")
    per_pass = cfg["parallel.dp"] * cfg["train.micro_batch_size"]
    gbs = cfg["train.global_batch_size"]
    if gbs:
        refuse(gbs % per_pass != 0, f"train.global_batch_size={gbs} is not divisible by parallel.dp x "
               f"train.micro_batch_size = {per_pass}")
        cfg["train.grad_accum_steps"] = gbs // per_pass


# ---- lattice's counter-based random numbers (core/rng.h), recomputed ----------

M64 = (1 << 64) - 1
M32 = 0xFFFFFFFF


def fnv1a64(name):
    h = 1469598103934665603
    for c in name.encode("utf-8"):
        h = ((h ^ c) * 1099511628211) & M64
    return h


def _key_of(seed, salt):
    k = ((seed * 0x9E3779B97F4A7C15) & M64) ^ (salt & M64)
    return k & M32, k >> 32


def philox4x32_10(key, c0, c1, c2, c3):
    """Philox4x32-10 (Salmon et al. 2011) on numpy uint64 arrays holding 32-bit words."""
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    m0, m1, mask = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57), np.uint64(M32)
    for _ in range(10):
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


def _uniform(bits):
    """(0, 1) from 32 random bits, in float32 arithmetic as lattice computes it."""
    return (((bits >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0))


def init_normal(seed, name, count):
    """N(0,1) for elements 0..count-1 of the tensor `name` (lattice's layout, row-major)."""
    idx = np.arange(count, dtype=np.uint64)
    r = philox4x32_10(_key_of(seed, fnv1a64(name)), idx & np.uint64(M32), idx >> np.uint64(32),
                      np.full(count, 0x1A77, np.uint64), np.zeros(count, np.uint64))
    u1, u2 = _uniform(r[0]).astype(np.float64), _uniform(r[1]).astype(np.float64)
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(6.283185307179586 * u2)).astype(np.float32)


class PhiloxStream:
    """lattice::Rng: key (seed, stream + 0x5EED), a 64-bit block counter, each
    block's four words handed out last first."""

    def __init__(self, seed, stream):
        self.key = _key_of(seed, (stream + 0x5EED) & M64)
        self.counter = 0
        self.words = []

    def next_u32(self):
        if not self.words:
            c = self.counter
            self.words = [int(w) for w in philox4x32_10(self.key, c & M32, c >> 32, 0, 0)]
            self.counter += 1
        return self.words.pop()

    def next_below(self, n):
        limit = M64 - M64 % n  # rejection removes the modulo bias
        while True:
            hi = self.next_u32()
            x = (hi << 32) | self.next_u32()
            if x < limit:
                return x % n


def init_spec(cfg, bias=True, mlp=None):
    """What lattice draws at init: [(HF name, shape in lattice's [out, in] layout,
    kind, conv1d)], kind "normal" (N(0, 0.02)), "proj" (N(0, 0.02/sqrt(2 n_layer)),
    the residual projections), "zeros" or "ones"; conv1d: HF stores the tensor
    transposed (Conv1D [in, out]). bias: the linear layers' biases; mlp(l, prefix):
    layer l's MLP entries (default GPT-2's dense C -> 4C -> C)."""
    L, C, V, T = cfg["model.n_layer"], cfg["model.n_embd"], cfg["model.vocab_size"], cfg["model.seq_len"]

    def dense_mlp(l, h):
        return [(h + "mlp.c_fc.weight", (4 * C, C), "normal", True), (h + "mlp.c_fc.bias", (4 * C,), "zeros", False),
                (h + "mlp.c_proj.weight", (C, 4 * C), "proj", True), (h + "mlp.c_proj.bias", (C,), "zeros", False)]
    mlp = mlp or dense_mlp
    spec = [("wte.weight", (V, C), "normal", False),  # lattice pads rows past V with zeros; HF drops them
            ("wpe.weight", (T, C), "normal", False)]
    for l in range(L):
        h = f"h.{l}."
        block = [(h + "ln_1.weight", (C,), "ones", False), (h + "ln_1.bias", (C,), "zeros", False),
                 (h + "attn.c_attn.weight", (3 * C, C), "normal", True),
                 (h + "attn.c_attn.bias", (3 * C,), "zeros", False),
                 (h + "attn.c_proj.weight", (C, C), "proj", True), (h + "attn.c_proj.bias", (C,), "zeros", False),
                 (h + "ln_2.weight", (C,), "ones", False), (h + "ln_2.bias", (C,), "zeros", False)] + mlp(l, h)
        spec += [e for e in block if bias or not (e[0].endswith(".bias") and ".ln_" not in e[0])]
    spec += [("ln_f.weight", (C,), "ones", False), ("ln_f.bias", (C,), "zeros", False)]
    return spec


def lattice_init(cfg, spec=None):
    """lattice's initial parameters for train.seed, as {HF name: float32 array in
    HF layout}: element i of lattice's [out, in] tensor `name` is
    std * init_normal(seed, name, .)[i]. spec: init_spec(cfg, ...)'s list (default GPT-2's)."""
    seed = cfg["train.seed"]
    std_w = np.float32(0.02)
    std_proj = np.float32(std_w / np.sqrt(np.float32(2 * cfg["model.n_layer"])))
    out = {}
    for name, shape, kind, conv1d in spec if spec is not None else init_spec(cfg):
        if kind in ("zeros", "ones"):
            out[name] = (np.zeros if kind == "zeros" else np.ones)(shape, np.float32)
            continue
        x = init_normal(seed, name, int(np.prod(shape))).reshape(shape) * (std_w if kind == "normal" else std_proj)
        out[name] = np.ascontiguousarray(x.T) if conv1d else x
    return out


# ---- data: llm.c shards and lattice's sampler (data/loader.h) ----------------

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
SHUFFLE_STREAM = 0xDA7A000000000000


def read_shard(path):
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 1024:
        raise ValueError(f"{path}: {raw.size} bytes, shorter than the 1024-byte header")
    header = raw[:1024].view("<i4")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: magic {header[0]}, version {header[1]}: not an llm.c version-1 shard")
    n = int(header[2])
    if raw.size != 1024 + 2 * n:
        raise ValueError(f"{path}: header says {n} tokens but the file is {raw.size} bytes")
    return raw[1024:].view("<u2").astype(np.int64)


class Sampler:
    """The global batches of lattice's DataLoader, in order."""

    def __init__(self, pattern, T, global_batch, micro_batches, seed, vocab_size):
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"data pattern '{pattern}' matches no file")
        self.tokens = np.concatenate([read_shard(p) for p in paths])
        if self.tokens.size and self.tokens.max() >= vocab_size:
            raise ValueError(f"data pattern '{pattern}': token {self.tokens.max()} >= vocab_size {vocab_size}")
        self.paths, self.T, self.G, self.A, self.seed = paths, T, global_batch, micro_batches, seed
        self.S = (self.tokens.size - 1) // T if self.tokens.size else 0
        if self.S < self.G:
            raise ValueError(f"{self.S} sequences, fewer than one global batch of {self.G}")
        self.steps_per_epoch = self.S // self.G
        self.epoch, self.position = 0, 0
        self.order = self._order()

    def _order(self):
        order = list(range(self.S))
        rng = PhiloxStream(self.seed, SHUFFLE_STREAM + self.epoch)
        for i in range(self.S, 1, -1):
            j = rng.next_below(i)
            order[i - 1], order[j] = order[j], order[i - 1]
        return order

    def next_step(self):
        """(sequence ids of the step, [(inputs, targets)] per micro-batch, int64 [G/A, T] each)."""
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._order()
        seqs = self.order[self.position * self.G:(self.position + 1) * self.G]
        self.position += 1
        rows = self.G // self.A
        T = self.T
        windows = np.stack([self.tokens[i * T:i * T + T + 1] for i in seqs])  # [G, T+1]
        micro = [(torch.from_numpy(windows[a * rows:(a + 1) * rows, :-1].copy()),
                  torch.from_numpy(windows[a * rows:(a + 1) * rows, 1:].copy())) for a in range(self.A)]
        return seqs, micro


# ---- bf16 compute, as lattice does it (docs/precision.md) --------------------

def bf16_round(x):
    return x.to(torch.bfloat16).to(torch.float32)


class RoundBF16(torch.autograd.Function):
    """A value rounded to bf16 where it is produced; the gradient passes through
    (lattice's backward runs in f32 on the stored bf16 values)."""

    @staticmethod
    def forward(ctx, x):
        return bf16_round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Bf16Linear(torch.autograd.Function):
    """y = x @ W + b on bf16 values summed in f32; the backward's GEMMs read dY
    rounded to bf16 (round_dy), the bias gradient sums the f32 dY."""

    @staticmethod
    def forward(ctx, x, w, b, round_dy=True):
        ctx.save_for_backward(x, w)
        ctx.round_dy = round_dy
        y = x.reshape(-1, x.shape[-1]) @ w
        if b is not None:
            y = y + b
        return y.view(x.shape[:-1] + (w.shape[1],))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gr = bf16_round(g2) if ctx.round_dy else g2
        dx = (gr @ w.t()).view(x.shape)
        dw = x.reshape(-1, x.shape[-1]).t() @ gr
        return dx, dw, g2.sum(0) if ctx.needs_input_grad[2] else None, None


def forward_loss_bf16(model, inputs, targets, rounding=True):
    """tools/gpt2_reference.py's GPT-2 with lattice's bf16 roundings (all of
    them off with rounding=False: then it is that model, for selftest())."""
    r = RoundBF16.apply if rounding else (lambda t: t)
    cfg = model.cfg
    B, T = inputs.shape
    C, H = cfg.n_embd, cfg.n_head
    hs = C // H
    wte = r(model.wte.weight)
    x = r(F.embedding(inputs, wte) + r(model.wpe.weight)[:T])

    def linear(x, mod):
        return Bf16Linear.apply(x, r(mod.weight), r(mod.bias), rounding)

    def ln(x, mod):
        return r(F.layer_norm(x, (C,), r(mod.weight), r(mod.bias), ref.LN_EPS))

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for block in model.h:
        qkv = r(linear(ln(x, block.ln_1), block.attn.c_attn))
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))).masked_fill(~causal, float("-inf"))
        y = r((F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(B, T, C))
        res = r(linear(y, block.attn.c_proj) + x)
        h = r(F.gelu(r(linear(ln(res, block.ln_2), block.mlp.c_fc)), approximate="tanh"))
        x = r(linear(h, block.mlp.c_proj) + res)
    x = ln(x, model.ln_f)
    logits = Bf16Linear.apply(x, wte.t(), None, rounding)  # the tied head; logits and loss stay f32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def selftest():
    """Philox against Random123's known answers (as tests/core/rng_test.cpp);
    the bf16 model with its roundings off against tools/gpt2_reference.py
    (loss and every gradient); with them on, within bf16's reach of it."""
    kat = [((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for key, ctr, want in kat:
        got = tuple(int(w) for w in philox4x32_10(key, *ctr))
        assert got == want, f"philox4x32_10{key, ctr} = {[hex(w) for w in got]}"
    cfg = ref.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=101, n_positions=16)
    model = ref.build_model(cfg)
    ref.init_params(model, seed=3)
    tok = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(4))
    x, y = tok[:, :-1], tok[:, 1:]

    def loss_and_grads(fn, **kw):
        model.zero_grad()
        loss = fn(model, x, y, **kw)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    a, ga = loss_and_grads(ref.forward_loss)
    b, gb = loss_and_grads(forward_loss_bf16, rounding=False)
    c, gc = loss_and_grads(forward_loss_bf16)
    assert abs(a - b) <= 1e-6 * abs(a), (a, b)
    for n in ga:
        err = float((ga[n] - gb[n]).abs().max()) / max(float(ga[n].abs().max()), 1e-30)
        assert err < 1e-5, f"{n}: the unrounded bf16 model's gradient differs by {err:.2e}"
    assert 1e-6 < abs(a - c) / abs(a) < 1e-2, (a, c)  # rounded: different, but only by bf16's precision
    return f"selftest ok: Philox known answers; bf16 model unrounded = reference, rounded loss {c:.6f} vs {a:.6f}"


# ---- the training run -----------------------------------------------------------

def clip_gradients(params, clip):
    """Global-norm clipping as lattice's (clip <= 0: none): the norm before clipping and the factor applied."""
    if clip > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        return norm, min(1.0, clip / (norm + 1e-6))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))), 1.0


def lr_at(s, cfg):
    """Warm-up to optim.lr, then cosine to optim.min_lr at the last step."""
    W, S = cfg["optim.warmup_steps"], cfg["train.steps"]
    max_lr, min_lr = cfg["optim.lr"], cfg["optim.min_lr"]
    if s < W:
        return max_lr * (s + 1) / W
    if S <= W:
        return max_lr
    ratio = min(1.0, (s - W) / (S - W))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def initial_state(cfg, spec=None):
    """{HF name: float32 tensor}: checkpoint.init_from's file, else lattice's
    seeded draw (of init_spec's tensors, or of spec's)."""
    path = cfg["checkpoint.init_from"]
    if not path:
        return {k: torch.from_numpy(v) for k, v in lattice_init(cfg, spec).items()}
    tensors, _ = safetensors_lite.load_torch(path)
    tensors = {k: v.to(torch.float32) for k, v in ref.strip_prefix(tensors).items()}
    if "wpe.weight" in tensors:  # longer-context weights: the first seq_len positions
        tensors["wpe.weight"] = tensors["wpe.weight"][:cfg["model.seq_len"]].contiguous()
    return tensors


def decayed(name, p):
    """GPT-2's decay mask: the 2-D tensors (wte, wpe, linear weights)."""
    return p.dim() >= 2


def train(cfg, threads=1, log=None):
    """Runs the recipe; returns {"steps": [per-step dicts], "model": model, "optimizer": opt, "init": {...}}."""
    torch.set_num_threads(threads)
    mcfg = ref.GPT2Config(n_layer=cfg["model.n_layer"], n_head=cfg["model.n_head"], n_embd=cfg["model.n_embd"],
                          vocab_size=cfg["model.vocab_size"], n_positions=cfg["model.seq_len"])
    model = ref.build_model(mcfg, torch.float32)
    init = initial_state(cfg)
    ref.load_state(model, init)
    init = {k: v.detach().clone() for k, v in ref.state_tensors(model).items()}
    named = list(model.named_parameters())
    params = [p for _, p in named]
    groups = [{"params": [p for n, p in named if decayed(n, p)], "weight_decay": cfg["optim.weight_decay"]},
              {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg["optim.lr"], betas=(cfg["optim.beta1"], cfg["optim.beta2"]),
                            eps=cfg["optim.eps"], foreach=False)
    A = cfg["train.grad_accum_steps"]
    G = cfg["parallel.dp"] * cfg["train.micro_batch_size"] * A
    sampler = Sampler(cfg["data.train"], cfg["model.seq_len"], G, A, cfg["train.seed"], cfg["model.vocab_size"])
    loss_fn = forward_loss_bf16 if cfg["precision.compute"] == "bf16" else ref.forward_loss
    clip = cfg["optim.grad_clip"]
    steps = []
    for s in range(cfg["train.steps"]):
        lr = lr_at(s, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        seqs, micro = sampler.next_step()
        epoch = sampler.epoch
        micro_losses = []
        for inputs, targets in micro:
            loss = loss_fn(model, inputs, targets)
            (loss / A).backward()
            micro_losses.append(loss.item())
        norm, scale = clip_gradients(params, clip)
        opt.step()
        rec = {"step": s + 1, "loss": sum(micro_losses) / A, "lr": lr, "grad_norm": norm, "clip_scale": scale,
               "micro_losses": micro_losses, "epoch": epoch, "sequences": [int(i) for i in seqs]}
        steps.append(rec)
        if log:
            log(f"step {s + 1:3d} | loss {rec['loss']:.6f} | lr {lr:.3e} | norm {norm:.4f}"
                f"{' (clipped)' if scale < 1 else ''} | epoch {epoch}")
    return {"steps": steps, "model": model, "optimizer": opt, "init": init, "sampler": sampler}


def moments(model, opt):
    """{NAME.exp_avg / NAME.exp_avg_sq: tensor}, as lattice's optimizer.safetensors names them."""
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        out[name + ".exp_avg"] = st["exp_avg"].detach()
        out[name + ".exp_avg_sq"] = st["exp_avg_sq"].detach()
    return out


def write_outputs(result, cfg, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for rec in result["steps"]:
            f.write(json.dumps(rec) + "\n")
    meta = {"format": "pt", "n_head": cfg["model.n_head"]}
    safetensors_lite.save_torch(os.path.join(out_dir, "init.safetensors"), result["init"], meta)
    ref.save_safetensors(result["model"], os.path.join(out_dir, "model.safetensors"))
    safetensors_lite.save_torch(os.path.join(out_dir, "optimizer.safetensors"),
                                moments(result["model"], result["optimizer"]))


# ---- comparing a lattice run ---------------------------------------------------

# Chosen from measurements (tools/README.md, "Tolerances"): each is several
# times the largest difference measured between implementations that follow
# the same recipe in a different summation order. None = not checked.
#   loss_rtol        every step's loss, relative
#   lr_rtol          every step's learning rate (lattice logs its f32 value)
#   norm_rtol        every step's grad norm before clipping, relative
#   first_norm_rtol  step 1's grad norm: same weights, same batch, so a pure
#                    check of the forward and backward
#   param_atol       max |lattice - torch| over each final parameter tensor
#   param_rel_l2     ||lattice - torch|| / ||torch|| per final parameter tensor
#   kbias_atol       max |lattice - torch| over the K third of every
#                    attn.c_attn.bias (excluded from the two above): its true
#                    gradient is exactly 0 (q·b_k is the same for every key),
#                    so both sides move it by Adam-normalised rounding noise
#   moment_rel_l2    ||lattice - torch|| / ||torch|| per Adam moment tensor
DEFAULT_TOLERANCES = {
    "f32": {"loss_rtol": 1e-5, "lr_rtol": 1e-6, "norm_rtol": 5e-5, "first_norm_rtol": 1e-6,
            "param_atol": 5e-5, "param_rel_l2": 2e-5, "kbias_atol": 5e-4, "moment_rel_l2": 5e-5},
    "bf16": {"loss_rtol": 1e-4, "lr_rtol": 1e-6, "norm_rtol": 2e-2, "first_norm_rtol": 5e-5,
             "param_atol": 5e-3, "param_rel_l2": 5e-3, "kbias_atol": 1e-3, "moment_rel_l2": 5e-2},
}


def read_metrics(path):
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
    return by_step


def checkpoint_dir(path):
    """A lattice checkpoint directory: `checkpoint.dir` (its latest) or one step_* directory."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    steps = sorted(d for d in os.listdir(path) if d.startswith("step_"))
    if not steps:
        raise FileNotFoundError(f"'{path}' holds no lattice checkpoint")
    return os.path.join(path, steps[-1])


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def _split_kbias(name, t):
    """(the tensor without the K third of an attn.c_attn.bias, that third or None)."""
    if name.endswith("attn.c_attn.bias"):
        C = t.shape[0] // 3
        return torch.cat([t[:C], t[2 * C:]]), t[C:2 * C]
    return t, None


def compare(result, cfg, metrics_path=None, ckpt_path=None, tol=None):
    """Compares a lattice run (its metrics JSONL and/or checkpoint directory)
    with the reference's result. Returns a report with the largest
    differences and `failures`, empty when everything is within `tol`."""
    tol = dict(DEFAULT_TOLERANCES[cfg["precision.compute"]], **(tol or {}))
    rep = {"tolerances": tol, "failures": []}
    fail = rep["failures"].append

    def check(value, key, what):
        if tol.get(key) is not None and not value <= tol[key]:  # NaN fails too
            fail(f"{what} = {value:.3e} > {key} {tol[key]:g}")

    if metrics_path:
        lat = read_metrics(metrics_path)
        worst = {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0}
        rep["per_step"] = []
        for rec in result["steps"]:
            k = rec["step"]
            if k not in lat:
                fail(f"metrics: step {k} missing from {metrics_path}")
                continue
            d = {key: _rel(float(lat[k][key]), rec[key]) for key in worst}
            rep["per_step"].append({"step": k, "lattice_loss": float(lat[k]["loss"]), "torch_loss": rec["loss"],
                                    "loss_rel": d["loss"], "lr_rel": d["lr"], "grad_norm_rel": d["grad_norm"]})
            for key in worst:
                worst[key] = max(worst[key], d[key])
            for key, t in (("loss", "loss_rtol"), ("lr", "lr_rtol"), ("grad_norm", "norm_rtol")):
                check(d[key], t, f"step {k}: {key} lattice {float(lat[k][key]):.9g} torch {rec[key]:.9g}, relative")
            if k == 1:
                rep["first_norm_rel"] = d["grad_norm"]
                check(d["grad_norm"], "first_norm_rtol", "step 1: grad norm, relative")
        rep["max_rel"] = worst
    if ckpt_path:
        d = checkpoint_dir(ckpt_path)
        with open(os.path.join(d, "meta.json")) as f:
            step = json.load(f)["step"]
        if step != cfg["train.steps"]:
            fail(f"checkpoint {d} is at step {step}, not train.steps={cfg['train.steps']}")
        lat_p, _ = safetensors_lite.load_torch(os.path.join(d, "model.safetensors"))
        lat_m, _ = safetensors_lite.load_torch(os.path.join(d, "optimizer.safetensors"))
        ours_p = ref.state_tensors(result["model"])
        ours_m = moments(result["model"], result["optimizer"])
        rep["params"], rep["kbias"], rep["moments"] = {}, {}, {}
        for name, ours in list(ours_p.items()) + list(ours_m.items()):
            src = lat_p if name in ours_p else lat_m
            if name not in src or tuple(src[name].shape) != tuple(ours.shape):
                fail(f"{name}: missing or of another shape in {d}")
                continue
            theirs = src[name].float()
            if name in ours_m:
                rl2 = float((theirs - ours).norm() / max(float(ours.norm()), 1e-30))
                rep["moments"][name] = {"rel_l2": rl2}
                check(rl2, "moment_rel_l2", f"{name}: ||lattice - torch|| / ||torch||")
                continue
            a, ka = _split_kbias(name, theirs)
            b, kb = _split_kbias(name, ours)
            m = {"max_abs": float((a - b).abs().max()), "rel_l2": float((a - b).norm() / max(float(b.norm()), 1e-30))}
            rep["params"][name] = m
            check(m["max_abs"], "param_atol", f"{name}: max |lattice - torch|")
            check(m["rel_l2"], "param_rel_l2", f"{name}: ||lattice - torch|| / ||torch||")
            if ka is not None:
                rep["kbias"][name] = float((ka - kb).abs().max())
                check(rep["kbias"][name], "kbias_atol", f"{name}[C:2C] (K bias): max |lattice - torch|")

        def worst(table, key=None):
            if not table:
                return None, None
            val = (lambda n: table[n][key]) if key else (lambda n: table[n])
            name = max(table, key=val)
            return val(name), name
        rep["param_max_abs"], rep["param_max_abs_in"] = worst(rep["params"], "max_abs")
        rep["param_rel_l2"], rep["param_rel_l2_in"] = worst(rep["params"], "rel_l2")
        rep["kbias_max_abs"], rep["kbias_max_abs_in"] = worst(rep["kbias"])
        rep["moment_rel_l2"], rep["moment_rel_l2_in"] = worst(rep["moments"], "rel_l2")
    return rep


SUMMARY_KEYS = ("max_rel", "first_norm_rel", "param_max_abs", "param_max_abs_in", "param_rel_l2", "param_rel_l2_in",
                "kbias_max_abs", "kbias_max_abs_in", "moment_rel_l2", "moment_rel_l2_in")


def run_command_line(tool, doc, argv, *, selftest, load, train, write, compare, tolerance_names, summary_keys,
                     extra_options=None):
    """The command line both reference tools share: -c/--set config, --out, --compare-*, --tol, --selftest.
    train(cfg, args) runs; extra_options(parser) adds a tool's own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", help="TOML run config, as for lattice train")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", help="write metrics.jsonl, init/model/optimizer.safetensors here")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    if extra_options:
        extra_options(ap)
    ap.add_argument("--compare-metrics", help="lattice's log.metrics_file of the same run")
    ap.add_argument("--compare-checkpoint", help="lattice's checkpoint.dir (or a step_* directory) of the same run")
    ap.add_argument("--tol", action="append", default=[], metavar="NAME=VALUE",
                    help="override one tolerance of DEFAULT_TOLERANCES (e.g. loss_rtol=1e-4; none = unchecked)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--selftest", action="store_true", help="check the tool's own pieces, then exit")
    args = ap.parse_args(argv)
    if args.selftest:
        print(selftest())
        return 0
    try:
        cfg = load(args.config, args.set)
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"{tool}: {e}", file=sys.stderr)
        return 2
    result = train(cfg, args)
    if args.out:
        write(result, cfg, args.out)
    if not (args.compare_metrics or args.compare_checkpoint):
        return 0
    tol = {}
    for item in args.tol:
        name, _, value = item.partition("=")
        if name not in tolerance_names:
            print(f"{tool}: --tol {item}: no tolerance '{name}' (valid: {', '.join(tolerance_names)})", file=sys.stderr)
            return 2
        tol[name] = None if value == "none" else float(value)
    rep = compare(result, cfg, args.compare_metrics, args.compare_checkpoint, tol)
    print(json.dumps({k: rep[k] for k in ("tolerances",) + summary_keys if k in rep}, indent=1))
    for f in rep["failures"]:
        print("MISMATCH " + f)
    return 1 if rep["failures"] else 0


def main(argv=None):
    return run_command_line(
        "torch_train_reference", __doc__, argv, selftest=selftest, load=load_config,
        train=lambda cfg, args: train(cfg, args.threads, None if args.quiet else print), write=write_outputs,
        compare=compare, tolerance_names=list(DEFAULT_TOLERANCES["f32"]), summary_keys=SUMMARY_KEYS)


if __name__ == "__main__":
    sys.exit(main())
