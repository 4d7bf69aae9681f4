"""Independent PyTorch GPT-2, parameter names and layouts as Hugging Face's
GPT-2 `model.safetensors` (no `transformer.` prefix, no lm_head: tied to wte).

Architecture (the one lattice implements):
    x = wte[idx] + wpe[pos]
    n_layer pre-LN blocks:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    attn: qkv = x @ c_attn.weight[C,3C] + c_attn.bias  (columns: Q | K | V,
          head h uses columns h*hs:(h+1)*hs of each part), causal softmax of
          q k^T / sqrt(hs), y = concat_heads(att v) @ c_proj.weight[C,C] + bias
    mlp:  gelu_tanh(x @ c_fc.weight[C,4C] + b) @ c_proj.weight[4C,C] + b
    LayerNorm eps 1e-5 (weight and bias); final ln_f
    logits = x @ wte^T (tied, no bias); loss = mean cross-entropy over B*T
    no dropout.

Linear weights are stored [in, out] (HF Conv1D): y = x @ W + b.

Use from other scripts (tools/ on sys.path):
    import gpt2_reference as ref
    cfg = ref.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=101, n_positions=16)
    model = ref.build_model(cfg)                   # zero-initialised; fill with init_params or load_safetensors
    ref.load_safetensors(model, "model.safetensors")
    loss = ref.forward_loss(model, inputs, targets)   # inputs/targets: int64 [B, T]
    ref.save_safetensors(model, "out.safetensors")
"""

import math
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402

LN_EPS = 1e-5


@dataclass
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    n_positions: int  # max sequence length (rows of wpe); lattice calls it model.seq_len

    def __post_init__(self):
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_head={self.n_head} does not divide n_embd={self.n_embd}")

    def to_dict(self):
        return asdict(self)


class Conv1D(nn.Module):
    """HF GPT-2's linear layer: weight [in, out], y = x @ W + b."""

    def __init__(self, n_in, n_out, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype))

    def forward(self, x):
        # addmm on the flattened rows: one GEMM plus bias, same as HF Conv1D.
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class LayerNorm(nn.Module):
    def __init__(self, n, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, LN_EPS)


class Attention(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd, dtype)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd, dtype)

    def forward(self, x):
        B, T, C = x.shape
        H, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)                # each [B, T, C]
        q = q.view(B, T, H, hs).transpose(1, 2)                 # [B, H, T, hs]
        k = k.view(B, T, H, hs).transpose(1, 2)
        v = v.view(B, T, H, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # [B, H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v                                             # [B, H, T, hs]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd, dtype)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd, dtype)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, dtype)
        self.attn = Attention(cfg, dtype)
        self.ln_2 = LayerNorm(cfg.n_embd, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    """named_parameters() yields exactly the HF GPT-2 names, in HF order."""

    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, dtype=dtype)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd, dtype=dtype)
        self.h = nn.ModuleList([Block(cfg, dtype) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, dtype)

    def forward(self, idx):
        """idx: int64 [B, T] -> logits [B, T, V]."""
        B, T = idx.shape
        if T > self.cfg.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions={self.cfg.n_positions}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()  # tied head, no bias


def build_model(cfg, dtype=torch.float32):
    """Model with placeholder values (zeros / LN ones); call init_params or load_safetensors."""
    return GPT2(cfg, dtype)


def forward_loss(model, inputs, targets):
    """Mean cross-entropy over all B*T positions."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def is_decayed(name, param):
    """lattice's weight-decay rule: tensors with dim >= 2 (wte, wpe, linear weights)."""
    return param.dim() >= 2


@torch.no_grad()
def init_params(model, seed=0, weight_std=0.02, ln_noise=0.1, bias_noise=0.02):
    """Deterministic init from a torch.Generator, in named_parameters() order:
    weights (dim>=2) ~ N(0, weight_std); LayerNorm weights 1 + ln_noise*N(0,1);
    biases (incl. LayerNorm bias) bias_noise*N(0,1) -- every parameter is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
        if p.dim() >= 2:
            p.copy_(noise * weight_std)
        elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            p.copy_(1.0 + ln_noise * noise)
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
    meta = {"format": "pt", "n_head": model.cfg.n_head}
    meta.update(metadata or {})
    safetensors_lite.save_torch(path, tensors, meta)


def strip_prefix(tensors):
    """Accepts HF names with or without the `transformer.` prefix."""
    out = {}
    for k, v in tensors.items():
        out[k[len("transformer."):] if k.startswith("transformer.") else k] = v
    return out


def infer_config(tensors, n_head):
    """n_layer, n_embd, vocab_size, n_positions from tensor shapes."""
    for name in ("wte.weight", "wpe.weight"):
        if name not in tensors:
            raise KeyError(f"no tensor {name} (nor transformer.{name}); is this a GPT-2 checkpoint?")
    V, C = tensors["wte.weight"].shape
    Tmax = tensors["wpe.weight"].shape[0]
    layers = {int(k.split(".")[1]) for k in tensors if k.startswith("h.")}
    n_layer = max(layers) + 1 if layers else 0
    return GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=C, vocab_size=V, n_positions=Tmax)


@torch.no_grad()
def load_state(model, tensors, strict_extra=False):
    """Copies {HF name: tensor} into the model. Missing names are an error;
    extra names (e.g. h.0.attn.bias masks, lm_head.weight) are ignored unless
    strict_extra. Returns the list of ignored names."""
    tensors = strip_prefix(tensors)
    params = dict(model.named_parameters())
    missing = [k for k in params if k not in tensors]
    if missing:
        raise KeyError(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    extra = sorted(k for k in tensors if k not in params)
    if extra and strict_extra:
        raise KeyError(f"unexpected tensors: {extra[:8]}")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {list(t.shape)} in file, model expects {list(p.shape)}")
        p.copy_(t.to(p.dtype))
    return extra


def load_safetensors(model, path, strict_extra=False):
    tensors, _ = safetensors_lite.load_torch(path)
    return load_state(model, tensors, strict_extra)


def model_from_safetensors(path, n_head=None, dtype=torch.float32):
    """Builds a model whose shape is inferred from the file; n_head from the
    argument or the file's __metadata__["n_head"]. Returns (model, ignored names, metadata)."""
    tensors, metadata = safetensors_lite.load_torch(path)
    tensors = strip_prefix(tensors)
    if n_head is None:
        if "n_head" not in metadata:
            raise ValueError(f"{path}: no __metadata__['n_head']; pass --n-head")
        n_head = int(metadata["n_head"])
    cfg = infer_config(tensors, n_head)
    model = build_model(cfg, dtype)
    ignored = load_state(model, tensors)
    return model, ignored, metadata


def count_params(model):
    """All parameters, the tied embedding counted once (wte + wpe + blocks + ln_f)."""
    return sum(p.numel() for p in model.parameters())


def _numpy_loss(tensors, cfg, inputs, targets):
    """A second, loop-per-head float64 numpy forward, for --selftest only."""
    import numpy as np
    P = {k: v.detach().double().numpy() for k, v in tensors.items()}
    B, T = inputs.shape
    C, H = cfg.n_embd, cfg.n_head
    hs = C // H

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + LN_EPS) * w + b

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    total = 0.0
    for b in range(B):
        x = P["wte.weight"][inputs[b]] + P["wpe.weight"][:T]
        for i in range(cfg.n_layer):
            p = lambda n: P[f"h.{i}.{n}"]  # noqa: E731
            a = ln(x, p("ln_1.weight"), p("ln_1.bias"))
            qkv = a @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
            y = np.zeros((T, C))
            for h in range(H):
                q = qkv[:, h * hs:(h + 1) * hs]
                k = qkv[:, C + h * hs:C + (h + 1) * hs]
                v = qkv[:, 2 * C + h * hs:2 * C + (h + 1) * hs]
                for t in range(T):
                    s = k[:t + 1] @ q[t] / math.sqrt(hs)
                    w = np.exp(s - s.max())
                    y[t, h * hs:(h + 1) * hs] = (w / w.sum()) @ v[:t + 1]
            x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
            a = ln(x, p("ln_2.weight"), p("ln_2.bias"))
            x = x + gelu(a @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")) @ p("mlp.c_proj.weight") \
                + p("mlp.c_proj.bias")
        x = ln(x, P["ln_f.weight"], P["ln_f.bias"])
        logits = x @ P["wte.weight"].T
        m = logits.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
        total += (lse - logits[np.arange(T), targets[b]]).sum()
    return total / (B * T)


def _selftest():
    """Checks the torch model against the numpy forward, and the safetensors round trip."""
    import tempfile
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=101, n_positions=16)
    model = build_model(cfg, torch.float64)
    init_params(model, seed=123)
    g = torch.Generator().manual_seed(5)
    tok = torch.randint(0, cfg.vocab_size, (3, 13), generator=g)
    x, y = tok[:, :-1], tok[:, 1:]
    a = forward_loss(model, x, y).item()
    b = _numpy_loss(state_tensors(model), cfg, x.numpy(), y.numpy())
    assert abs(a - b) < 1e-12 * abs(b), (a, b)
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["wte.weight", "wpe.weight", "h.0.ln_1.weight"], names[:3]
    assert dict(model.named_parameters())["h.1.attn.c_attn.weight"].shape == (32, 96)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.safetensors")
        save_safetensors(model, path, dtype=torch.float64)
        # with a transformer. prefix and an extra mask buffer, as HF files have
        tensors, meta = safetensors_lite.load_torch(path)
        tensors = {"transformer." + k: v for k, v in tensors.items()}
        tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
        safetensors_lite.save_torch(path, tensors, meta)
        m2, ignored, _ = model_from_safetensors(path, dtype=torch.float64)
        assert ignored == ["h.0.attn.bias"], ignored
        assert m2.cfg == cfg, m2.cfg
        assert forward_loss(m2, x, y).item() == a
    print(f"selftest ok: torch {a:.15f} numpy {b:.15f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--selftest"]:
        _selftest()
    else:
        print(__doc__)
