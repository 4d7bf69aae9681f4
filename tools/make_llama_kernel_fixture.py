#!/usr/bin/python3
"""Writes the PyTorch side of lattice's Llama kernel tests (RMSNorm, SwiGLU, RoPE).

Run:  /usr/bin/python3 tools/make_llama_kernel_fixture.py [--out tests/kernels/fixtures]

Writes llama_kernels.safetensors (all F32; seeded torch.Generator, 1 thread,
so the file is the same on every run of the same torch). Each op is written
here from the HF transformers conventions (modeling_llama.py), not from
lattice's code, and its backward is torch autograd's:

RMSNorm (LlamaRMSNorm, f32):
    variance = x.pow(2).mean(-1, keepdim=True)
    out = weight * (x * torch.rsqrt(variance + eps))
  rmsnorm.x [N, C], rmsnorm.weight [C], rmsnorm.out, rmsnorm.rstd [N]
  (= rsqrt(variance + eps)), rmsnorm.dout (upstream gradient),
  rmsnorm.dx, rmsnorm.dweight (autograd of sum(out * dout)).
  Rows 0..1 are scaled by 1e3 and 1e-3 (rstd far from 1).

SwiGLU (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU), the
fused projection's output laid out [N, 2F] as gate | up:
  swiglu.inp [N, 2F], swiglu.out [N, F] = F.silu(g) * u, swiglu.dout,
  swiglu.dinp [N, 2F] = (dg | du). Some gates are large (+-30, +-100, -90).

RoPE (LlamaRotaryEmbedding + apply_rotary_pos_emb, rotate_half):
    inv_freq = 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1); cos = emb.cos(); sin = emb.sin()
    q_embed = q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x2, x1)
  q and k are stored in lattice's [B, T, heads, hs] layout (HF's own layout
  is [B, heads, T, hs]: the script transposes around the HF code). k has
  fewer heads than q (grouped-query attention). Positions are
  first_position .. first_position + T - 1 for every sequence.
  rope.q [B, T, NH, hs], rope.k [B, T, NKV, hs], rope.q_out, rope.k_out,
  rope.dq_out, rope.dk_out (upstream gradients), rope.dq, rope.dk (autograd),
  rope.cos, rope.sin [max_positions, hs] (positions 0..max_positions-1),
  rope.inv_freq [hs/2].
  rope_table.*: a Llama 3 sized table (hs = 128, theta = 500000) at a few
  positions up to 8191, where the f32 angle p * inv_freq is what matters:
  rope_table.positions [P] (exact integers as F32), rope_table.cos,
  rope_table.sin [P, hs], rope_table.inv_freq [hs/2].

Sizes and constants are in __metadata__.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_lite  # noqa: E402

SEED = 20
RMS_N, RMS_C, RMS_EPS = 7, 40, 1e-5
SWI_N, SWI_F = 5, 37
ROPE_B, ROPE_T, ROPE_NH, ROPE_NKV, ROPE_HS = 2, 7, 3, 1, 16
ROPE_THETA, ROPE_MAX_POSITIONS, ROPE_FIRST = 10000.0, 16, 5
TABLE_HS, TABLE_THETA = 128, 500000.0
TABLE_POSITIONS = [0, 1, 2, 3, 100, 511, 2047, 4095, 8191]


def rmsnorm(x, weight, eps):
    variance = x.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    return weight * (x * rstd), rstd.squeeze(-1)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def inv_freq_of(hs, theta):
    return 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))


def cos_sin(inv_freq, position_ids):
    """position_ids [B, T] -> cos, sin [B, T, hs] (LlamaRotaryEmbedding.forward, f32)."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                                      "kernels", "fixtures"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(SEED)
    t = {}

    # ---- RMSNorm
    x = torch.randn(RMS_N, RMS_C, generator=g) * 1.5 + 0.2
    x[0] *= 1e3
    x[1] *= 1e-3
    w = 1.0 + 0.2 * torch.randn(RMS_C, generator=g)
    dout = torch.randn(RMS_N, RMS_C, generator=g)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out, rstd = rmsnorm(x, w, RMS_EPS)
    (out * dout).sum().backward()
    t.update({"rmsnorm.x": x, "rmsnorm.weight": w, "rmsnorm.out": out, "rmsnorm.rstd": rstd,
              "rmsnorm.dout": dout, "rmsnorm.dx": x.grad, "rmsnorm.dweight": w.grad})

    # ---- SwiGLU
    inp = torch.randn(SWI_N, 2 * SWI_F, generator=g) * 2.0
    inp[0, :6] = torch.tensor([30.0, -30.0, 100.0, -100.0, -90.0, 0.0])
    dout = torch.randn(SWI_N, SWI_F, generator=g)
    inp.requires_grad_(True)
    gate, up = inp[:, :SWI_F], inp[:, SWI_F:]
    out = F.silu(gate) * up
    (out * dout).sum().backward()
    t.update({"swiglu.inp": inp, "swiglu.out": out, "swiglu.dout": dout, "swiglu.dinp": inp.grad})

    # ---- RoPE (lattice layout [B, T, heads, hs] <-> HF's [B, heads, T, hs])
    q = torch.randn(ROPE_B, ROPE_T, ROPE_NH, ROPE_HS, generator=g)
    k = torch.randn(ROPE_B, ROPE_T, ROPE_NKV, ROPE_HS, generator=g)
    dq_out = torch.randn(ROPE_B, ROPE_T, ROPE_NH, ROPE_HS, generator=g)
    dk_out = torch.randn(ROPE_B, ROPE_T, ROPE_NKV, ROPE_HS, generator=g)
    q.requires_grad_(True)
    k.requires_grad_(True)
    inv_freq = inv_freq_of(ROPE_HS, ROPE_THETA)
    position_ids = torch.arange(ROPE_FIRST, ROPE_FIRST + ROPE_T, dtype=torch.int64)[None, :].expand(ROPE_B, -1)
    cos, sin = cos_sin(inv_freq, position_ids)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_out, k_out = q_hf.transpose(1, 2), k_hf.transpose(1, 2)
    ((q_out * dq_out).sum() + (k_out * dk_out).sum()).backward()
    all_positions = torch.arange(ROPE_MAX_POSITIONS, dtype=torch.int64)[None, :]
    table_cos, table_sin = cos_sin(inv_freq, all_positions)
    t.update({"rope.q": q, "rope.k": k, "rope.q_out": q_out, "rope.k_out": k_out, "rope.dq_out": dq_out,
              "rope.dk_out": dk_out, "rope.dq": q.grad, "rope.dk": k.grad, "rope.cos": table_cos[0],
              "rope.sin": table_sin[0], "rope.inv_freq": inv_freq})

    inv_freq3 = inv_freq_of(TABLE_HS, TABLE_THETA)
    positions = torch.tensor(TABLE_POSITIONS, dtype=torch.int64)
    cos3, sin3 = cos_sin(inv_freq3, positions[None, :])
    t.update({"rope_table.positions": positions.float(), "rope_table.cos": cos3[0], "rope_table.sin": sin3[0],
              "rope_table.inv_freq": inv_freq3})

    arrays = {}
    for name, tensor in t.items():
        tensor = tensor.detach().contiguous()
        assert tensor.dtype == torch.float32, name
        arrays[name] = tensor.numpy()
    metadata = {
        "generator": "tools/make_llama_kernel_fixture.py", "torch": torch.__version__, "seed": SEED,
        "rmsnorm.eps": repr(RMS_EPS), "swiglu.F": SWI_F,
        "rope.B": ROPE_B, "rope.T": ROPE_T, "rope.NH": ROPE_NH, "rope.NKV": ROPE_NKV, "rope.head_size": ROPE_HS,
        "rope.theta": repr(ROPE_THETA), "rope.max_positions": ROPE_MAX_POSITIONS,
        "rope.first_position": ROPE_FIRST,
        "rope_table.head_size": TABLE_HS, "rope_table.theta": repr(TABLE_THETA),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "llama_kernels.safetensors")
    safetensors_lite.save_numpy(path, arrays, metadata)
    print(f"wrote {os.path.normpath(path)} ({os.path.getsize(path)} bytes, {len(arrays)} tensors)")


if __name__ == "__main__":
    main()
