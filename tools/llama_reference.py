#!/usr/bin/python3
"""Independent PyTorch Llama, written from Hugging Face transformers'
LlamaForCausalLM (modeling_llama.py, eager attention) with its parameter
names, layouts and config.json. Shares no code with lattice.

Architecture, in HF's order of operations:
    x = embed_tokens[idx]
    per layer:  x = x + o_proj(attn(input_layernorm(x)))
                h = post_attention_layernorm(x)
                x = x + down_proj(silu(gate_proj(h)) * up_proj(h))
    logits = lm_head(norm(x))          (lm_head is embed_tokens when tied)
    loss = mean cross-entropy over every position (logits in f32)

RMSNorm (LlamaRMSNorm): x in f32, variance = mean(x²), x * rsqrt(variance + eps),
back to the input dtype, then weight * that.

RoPE (LlamaRotaryEmbedding, rope_type "default", apply_rotary_pos_emb):
    inv_freq = 1 / theta ** (arange(0, hs, 2, int64).float() / hs)      (f32)
    freqs = inv_freq ⊗ position (f32), emb = cat(freqs, freqs), cos/sin of emb (f32,
    then cast to the compute dtype, as HF does even in a float64 model)
    q' = q·cos + rotate_half(q)·sin,  rotate_half(x) = cat(-x[hs/2:], x[:hs/2])
  on the queries and keys after the projections; positions 0..T-1.
  (tools/make_llama_kernel_fixture.py holds lattice's RoPE kernel to the same code.)

Attention: q [B, n_head, T, hs], k/v [B, n_kv_head, T, hs]; repeat_kv expands
each key/value head to the n_head / n_kv_head query heads after it (query
head h reads key/value head h // (n_head / n_kv_head)); scores q·kᵀ · hs^-½,
causal mask, softmax in f32, · v, heads concatenated back to n_head·hs.

Parameters (HF names; nn.Linear weights [out, in], y = x Wᵀ + b):
    model.embed_tokens.weight                         [V, C]
    model.layers.N.self_attn.q_proj.weight            [n_head·hs, C]
    model.layers.N.self_attn.{k,v}_proj.weight        [n_kv_head·hs, C]
    model.layers.N.self_attn.o_proj.weight            [C, n_head·hs]
    model.layers.N.mlp.{gate,up}_proj.weight          [F, C]
    model.layers.N.mlp.down_proj.weight               [C, F]
    model.layers.N.{input,post_attention}_layernorm.weight   [C]
    model.norm.weight                                 [C]
    lm_head.weight                                    [V, C]   (absent when tied)
  with attention_bias: {q,k,v,o}_proj.bias; with mlp_bias: {gate,up,down}_proj.bias.
named_parameters() yields exactly these, in HF's order.

config.json: the HF LlamaConfig keys (architectures ["LlamaForCausalLM"],
model_type "llama", hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings,
rms_norm_eps, rope_theta, vocab_size, tie_word_embeddings, attention_bias,
mlp_bias, hidden_act "silu", torch_dtype). Absent optional keys take HF's
defaults; rope_scaling other than null and hidden_act other than silu are refused.

Command line (reads only DIR/config.json and DIR/model.safetensors):
    llama_reference.py eval --model DIR --tokens 1,2,3,...
        → {"loss": mean CE of predicting tokens[1:] from tokens[:-1]}
    llama_reference.py generate --model DIR --prompt 1,2,3 --n 8
        → {"tokens": [the n new tokens]}: greedy (argmax, lowest id on ties),
          the whole context recomputed for every token (no cache); once the
          context is longer than max_position_embeddings the model sees its
          most recent max_position_embeddings tokens at positions 0.. (as
          lattice generate does)
    llama_reference.py selftest
  Options: --weights FILE (instead of DIR/model.safetensors), --dtype float64.

From other scripts (tools/ on sys.path):
    import llama_reference as ref
    cfg = ref.LlamaConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=101, max_positions=16,
                          n_kv_head=2, ffn_hidden=64)
    model = ref.build_model(cfg)                 # then ref.init_params(model, seed) or:
    ref.load_safetensors(model, "model.safetensors")
    loss = ref.forward_loss(model, inputs, targets)   # int64 [B, T] each
    ref.save_safetensors(model, "out.safetensors")    # grads=True writes .grad instead
    ref.write_config(cfg, "config.json");  cfg = ref.read_config("config.json")
"""

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402


@dataclass
class LlamaConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    max_positions: int          # max_position_embeddings (lattice: model.seq_len)
    n_kv_head: int = 0          # 0: n_head
    ffn_hidden: int = 0         # intermediate_size; 0: 4·C
    head_dim: int = 0           # 0: n_embd // n_head
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.ffn_hidden == 0:
            self.ffn_hidden = 4 * self.n_embd
        if self.head_dim == 0:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}: give head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"num_key_value_heads={self.n_kv_head} does not divide "
                             f"num_attention_heads={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: rotate_half needs an even head size")


# ---- config.json ---------------------------------------------------------

def config_to_hf(cfg, torch_dtype="float32"):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        "torch_dtype": torch_dtype,
    }


def config_from_hf(d, source="config.json"):
    """LlamaConfig from an HF config dict; absent optional keys take LlamaConfig's defaults."""
    if d.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: model_type is {d['model_type']!r}, expected 'llama'")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("rope_scaling") is not None:
        raise ValueError(f"{source}: rope_scaling {d['rope_scaling']!r} is not supported (only null)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in d:
            raise ValueError(f"{source}: missing key {key!r}")
    return LlamaConfig(
        n_layer=int(d["num_hidden_layers"]), n_head=int(d["num_attention_heads"]), n_embd=int(d["hidden_size"]),
        vocab_size=int(d["vocab_size"]), max_positions=int(d.get("max_position_embeddings", 2048)),
        n_kv_head=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        ffn_hidden=int(d.get("intermediate_size", 11008)), head_dim=int(d.get("head_dim") or 0),
        rope_theta=float(d.get("rope_theta", 10000.0)), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)))


def write_config(cfg, path, torch_dtype="float32"):
    with open(path, "w") as f:
        json.dump(config_to_hf(cfg, torch_dtype), f, indent=2)
        f.write("\n")


def read_config(path):
    with open(path) as f:
        return config_from_hf(json.load(f), path)


# ---- the model -----------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, n, eps, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        input_dtype = x.dtype
        h = x.to(torch.float32) if input_dtype != torch.float64 else x
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)


def rope_inv_freq(head_dim, theta):
    """HF's default rope: f32, from an int64 arange."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(head_dim, theta, T, dtype):
    """cos, sin [T, head_dim] for positions 0..T-1, computed in f32 as HF does, then cast to dtype."""
    inv_freq = rope_inv_freq(head_dim, theta)
    positions = torch.arange(T, dtype=torch.int64)
    freqs = (inv_freq[:, None].float() @ positions[None, :].float()).transpose(0, 1)  # [T, hs/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q [B, H, T, hs], k [B, KV, T, hs], cos/sin [T, hs]."""
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    """[B, KV, T, hs] -> [B, KV·n_rep, T, hs]: key/value head j serves query heads j·n_rep .. j·n_rep+n_rep-1."""
    B, KV, T, hs = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, KV, n_rep, T, hs).reshape(B, KV * n_rep, T, hs)


class Attention(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.cfg = cfg
        C, H, KV, hs = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(C, H * hs, bias=b, dtype=dtype)
        self.k_proj = nn.Linear(C, KV * hs, bias=b, dtype=dtype)
        self.v_proj = nn.Linear(C, KV * hs, bias=b, dtype=dtype)
        self.o_proj = nn.Linear(H * hs, C, bias=b, dtype=dtype)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        H, KV, hs = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, hs).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV, hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV, hs).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, H // KV)
        v = repeat_kv(v, H // KV)
        att = torch.matmul(q, k.transpose(2, 3)) * hs ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf"))
        softmax_dtype = torch.float64 if att.dtype == torch.float64 else torch.float32
        att = F.softmax(att, dim=-1, dtype=softmax_dtype).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().reshape(B, T, H * hs)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        C, Fh, b = cfg.n_embd, cfg.ffn_hidden, cfg.mlp_bias
        self.gate_proj = nn.Linear(C, Fh, bias=b, dtype=dtype)
        self.up_proj = nn.Linear(C, Fh, bias=b, dtype=dtype)
        self.down_proj = nn.Linear(Fh, C, bias=b, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        # Declared in LlamaDecoderLayer's order, so named_parameters() follows HF's.
        self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps, dtype)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, dtype) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """named_parameters() yields exactly the HF names, in HF order (lm_head absent when tied)."""

    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.model = LlamaModel(cfg, dtype)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx):
        """idx: int64 [B, T] -> logits [B, T, V] (f32, or f64 in a float64 model)."""
        B, T = idx.shape
        if T > self.cfg.max_positions:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings={self.cfg.max_positions}")
        cos, sin = rope_cos_sin(self.cfg.head_dim, self.cfg.rope_theta, T, self.dtype)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        return logits if logits.dtype == torch.float64 else logits.float()


def build_model(cfg, dtype=torch.float32):
    """Model with placeholder values (nn.Linear's default init, norms 1); call init_params or load_safetensors."""
    return LlamaForCausalLM(cfg, dtype)


def forward_loss(model, inputs, targets):
    """Mean cross-entropy over all B*T positions."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def is_decayed(name, param):
    """lattice's weight-decay rule: tensors with dim >= 2 (embedding, head, linear weights)."""
    return param.dim() >= 2


def is_norm_weight(name):
    return name.endswith("layernorm.weight") or name == "model.norm.weight"


@torch.no_grad()
def init_params(model, seed=0, weight_std=0.02, norm_noise=0.0, bias_noise=0.0):
    """Deterministic init from a torch.Generator seeded `seed`: one N(0,1) draw of each
    parameter's shape, in named_parameters() order (f32, then cast), used as
    weights (dim >= 2): weight_std·N;  RMSNorm weights: 1 + norm_noise·N;  biases: bias_noise·N.
    The defaults are HF's _init_weights with initializer_range 0.02 (norms 1, biases 0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
        if p.dim() >= 2:
            p.copy_(noise * weight_std)
        elif is_norm_weight(name):
            p.copy_(1.0 + norm_noise * noise)
        else:
            p.copy_(bias_noise * noise)


def state_tensors(model, grads=False):
    """{HF name: tensor} of the parameters (or of their .grad)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            raise ValueError(f"parameter {name} has no gradient")
        out[name] = t.detach()
    return out


def save_safetensors(model, path, metadata=None, grads=False, dtype=torch.float32):
    """Writes parameters (or gradients) under HF names, converted to dtype."""
    tensors = {k: v.to(dtype) for k, v in state_tensors(model, grads).items()}
    meta = {"format": "pt"}
    meta.update(metadata or {})
    safetensors_lite.save_torch(path, tensors, meta)


@torch.no_grad()
def load_state(model, tensors, source="tensors"):
    """Copies {HF name: tensor} into the model. A missing or extra name, or a
    wrong shape, is an error naming it; with a tied head, lm_head.weight may be
    present only if it equals model.embed_tokens.weight."""
    params = dict(model.named_parameters())
    tensors = dict(tensors)
    if model.cfg.tie_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not torch.equal(head.float(), emb.float()):
            raise ValueError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embed_tokens.weight")
    missing = [k for k in params if k not in tensors]
    if missing:
        raise KeyError(f"{source}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    extra = sorted(k for k in tensors if k not in params)
    if extra:
        raise KeyError(f"{source}: tensors this config has no place for: {extra[:8]}"
                       f"{' ...' if len(extra) > 8 else ''}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{source}: {name}: shape {list(t.shape)} in the file, config.json implies "
                             f"{list(p.shape)}")
        p.copy_(t.to(p.dtype))


def load_safetensors(model, path):
    tensors, _ = safetensors_lite.load_torch(path)
    load_state(model, tensors, path)


def load_dir(model_dir, weights=None, dtype=torch.float32):
    """The model of an HF directory: DIR/config.json, DIR/model.safetensors (or `weights`)."""
    cfg = read_config(os.path.join(model_dir, "config.json"))
    model = build_model(cfg, dtype)
    load_safetensors(model, weights or os.path.join(model_dir, "model.safetensors"))
    return model


def argmax_lowest(logits):
    """Index of the largest value, the lowest index among equal maxima."""
    return int((logits == logits.max()).nonzero()[0, 0])


@torch.no_grad()
def sequence_loss(model, tokens):
    """Mean CE of predicting tokens[1:] from tokens[:-1] (one sequence)."""
    t = torch.tensor(tokens, dtype=torch.int64)[None, :]
    return forward_loss(model, t[:, :-1], t[:, 1:]).item()


@torch.no_grad()
def generate_greedy(model, prompt, n):
    """n new tokens, greedy; the whole context (its last max_positions tokens) recomputed every step."""
    context = list(prompt)
    out = []
    for _ in range(n):
        window = context[-model.cfg.max_positions:]
        logits = model(torch.tensor(window, dtype=torch.int64)[None, :])[0, -1]
        nxt = argmax_lowest(logits)
        out.append(nxt)
        context.append(nxt)
    return out


# ---- selftest ------------------------------------------------------------

def _numpy_loss(tensors, cfg, inputs, targets):
    """A second forward in float64 numpy, one loop per head and per position, for selftest only.
    RoPE by its definition, in float64: the pair (i, i + hs/2) of a head rotated by the angle
    position · theta^(-2i/hs) (the torch model takes HF's f32 angles: they differ by ~1e-7)."""
    import numpy as np
    P = {k: v.detach().double().numpy() for k, v in tensors.items()}
    B, T = inputs.shape
    H, KV, hs = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    half = hs // 2

    def lin(x, name):
        y = x @ P[name + ".weight"].T
        return y + P[name + ".bias"] if name + ".bias" in P else y

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rope(v, t):  # v [hs] at position t
        out = np.empty(hs)
        for i in range(half):
            angle = t * cfg.rope_theta ** (-2.0 * i / hs)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = v[i] * c - v[i + half] * s
            out[i + half] = v[i + half] * c + v[i] * s
        return out

    total = 0.0
    for b in range(B):
        x = P["model.embed_tokens.weight"][inputs[b]]
        for li in range(cfg.n_layer):
            pre = f"model.layers.{li}."
            a = rms(x, P[pre + "input_layernorm.weight"])
            q, k, v = (lin(a, pre + f"self_attn.{w}_proj") for w in "qkv")
            y = np.zeros((T, H * hs))
            for h in range(H):
                j = h // (H // KV)  # the key/value head of query head h
                for t in range(T):
                    qt = rope(q[t, h * hs:(h + 1) * hs], t)
                    s = np.array([qt @ rope(k[u, j * hs:(j + 1) * hs], u) for u in range(t + 1)]) / math.sqrt(hs)
                    w = np.exp(s - s.max())
                    y[t, h * hs:(h + 1) * hs] = (w / w.sum()) @ v[:t + 1, j * hs:(j + 1) * hs]
            x = x + lin(y, pre + "self_attn.o_proj")
            a = rms(x, P[pre + "post_attention_layernorm.weight"])
            g = lin(a, pre + "mlp.gate_proj")
            x = x + lin(g / (1 + np.exp(-g)) * lin(a, pre + "mlp.up_proj"), pre + "mlp.down_proj")
        x = rms(x, P["model.norm.weight"])
        head = P["lm_head.weight"] if "lm_head.weight" in P else P["model.embed_tokens.weight"]
        logits = x @ head.T
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        total += (lse - logits[np.arange(T), targets[b]]).sum()
    return total / (B * T)


def mha_equivalent(model):
    """A model with n_kv_head = n_head whose k/v weights repeat each key/value head's rows
    for its query heads: plain multi-head attention computing what `model` computes."""
    cfg = model.cfg
    from dataclasses import replace
    mcfg = replace(cfg, n_kv_head=cfg.n_head)
    mha = build_model(mcfg, model.dtype)
    rep, hs = cfg.n_head // cfg.n_kv_head, cfg.head_dim
    tensors = {}
    for name, t in state_tensors(model).items():
        if ".k_proj." in name or ".v_proj." in name:
            t = t.reshape(cfg.n_kv_head, hs, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(
                cfg.n_head * hs, *t.shape[1:])
        tensors[name] = t
    load_state(mha, tensors)
    return mha


def _selftest():
    """The torch model against the numpy forward (GQA, MQA, MHA; tied; biases; head_dim ≠ C/H),
    grouped heads against their MHA equivalent, HF names and order, config.json and
    safetensors round trips, refusals."""
    import tempfile
    g = torch.Generator().manual_seed(5)
    base = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=101, max_positions=16, ffn_hidden=64)
    cases = [dict(n_kv_head=4), dict(n_kv_head=2), dict(n_kv_head=1),
             dict(n_kv_head=2, tie_embeddings=True, attention_bias=True, mlp_bias=True),
             dict(n_kv_head=2, head_dim=6, rope_theta=500.0, norm_eps=1e-6)]
    tok = torch.randint(0, 101, (2, 12), generator=g)
    x, y = tok[:, :-1], tok[:, 1:]
    for i, extra in enumerate(cases):
        cfg = LlamaConfig(**base, **extra)
        model = build_model(cfg, torch.float64)
        init_params(model, seed=100 + i, weight_std=0.1, norm_noise=0.1, bias_noise=0.05)
        a = forward_loss(model, x, y).item()
        b = _numpy_loss(state_tensors(model), cfg, x.numpy(), y.numpy())
        assert abs(a - b) < 1e-8 * abs(b), (extra, a, b)
        mha = mha_equivalent(model)
        c = forward_loss(mha, x, y).item()
        assert abs(a - c) < 1e-13 * abs(a), (extra, a, c)
        print(f"selftest {extra}: torch {a:.15f} numpy {b:.15f} mha-equivalent {c:.15f}")

    cfg = LlamaConfig(**base, n_kv_head=2)
    model = build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert names[:4] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"], names
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"], names[-2:]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 32)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (32, 32)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (32, 64)
    assert shapes["lm_head.weight"] == (101, 32)
    tied = build_model(LlamaConfig(**base, tie_embeddings=True))
    assert "lm_head.weight" not in dict(tied.named_parameters())

    init_params(model, seed=7)
    with tempfile.TemporaryDirectory() as d:
        write_config(cfg, os.path.join(d, "config.json"))
        assert read_config(os.path.join(d, "config.json")) == cfg
        save_safetensors(model, os.path.join(d, "model.safetensors"))
        m2 = load_dir(d)
        assert forward_loss(m2, x, y).item() == forward_loss(model, x, y).item()
        tensors, _ = safetensors_lite.load_torch(os.path.join(d, "model.safetensors"))
        for broken, what in ((dict(tensors, **{"model.layers.0.extra": torch.zeros(1)}), "no place for"),
                             ({k: v for k, v in tensors.items() if k != "lm_head.weight"}, "missing"),
                             (dict(tensors, **{"model.norm.weight": torch.zeros(31)}), "shape")):
            try:
                load_state(build_model(cfg), broken)
                raise AssertionError(f"accepted a file with {what}")
            except (KeyError, ValueError) as e:
                assert what in str(e), e
    for bad, what in ((dict(model_type="gpt2"), "model_type"), (dict(hidden_act="gelu"), "hidden_act"),
                      (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling")):
        try:
            config_from_hf(dict(config_to_hf(cfg), **bad))
            raise AssertionError(f"accepted {bad}")
        except ValueError as e:
            assert what in str(e), e
    assert argmax_lowest(torch.tensor([0.0, 2.0, 1.0, 2.0])) == 1
    print("selftest ok")


# ---- command line --------------------------------------------------------

def _token_list(text, flag):
    try:
        return [int(s) for s in text.replace(" ", "").split(",") if s != ""]
    except ValueError:
        raise SystemExit(f"llama_reference.py: {flag} must be comma-separated token ids, got {text!r}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Read the module docstring for the model's definition.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("eval", "generate"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="folder with config.json and model.safetensors")
        p.add_argument("--weights", help="a safetensors file instead of MODEL/model.safetensors")
        p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
        if name == "eval":
            p.add_argument("--tokens", required=True, help="comma-separated token ids (at least 2)")
        else:
            p.add_argument("--prompt", required=True, help="comma-separated token ids (at least 1)")
            p.add_argument("--n", type=int, required=True, help="new tokens to generate")
    sub.add_parser("selftest")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "selftest":
        _selftest()
        return 0
    try:
        model = load_dir(args.model, args.weights, torch.float64 if args.dtype == "float64" else torch.float32)
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"llama_reference.py: {e}")
    V = model.cfg.vocab_size
    if args.command == "eval":
        tokens = _token_list(args.tokens, "--tokens")
        if len(tokens) < 2 or len(tokens) > model.cfg.max_positions + 1:
            raise SystemExit(f"llama_reference.py: --tokens has {len(tokens)} ids; give 2 to "
                             f"max_position_embeddings + 1 = {model.cfg.max_positions + 1}")
    else:
        tokens = _token_list(args.prompt, "--prompt")
        if not tokens or args.n < 1:
            raise SystemExit("llama_reference.py: --prompt needs at least one id and --n must be >= 1")
    bad = [t for t in tokens if not 0 <= t < V]
    if bad:
        raise SystemExit(f"llama_reference.py: token ids {bad[:8]} are outside [0, vocab_size={V})")
    if args.command == "eval":
        print(json.dumps({"loss": sequence_loss(model, tokens)}))
    else:
        print(json.dumps({"tokens": generate_greedy(model, tokens, args.n)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
