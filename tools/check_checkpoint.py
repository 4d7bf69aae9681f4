#!/usr/bin/python3
"""Evaluates a lattice checkpoint with the independent PyTorch GPT-2.

    /usr/bin/python3 tools/check_checkpoint.py --model CKPT/model.safetensors \\
        --tokens data/val_000000.bin --batch 4 --seq 64 [--n-head 12] \\
        [--expect 3.2841 --rtol 1e-5]

--model: safetensors with HF GPT-2 names (with or without a `transformer.`
  prefix; extra keys such as h.N.attn.bias or lm_head.weight are ignored; the
  head is tied to wte). F32, BF16 and F16 tensors are accepted (computed in
  fp32, or fp64 with --double). n_layer, n_embd, vocab_size and the number of
  positions come from the tensor shapes; n_head from --n-head or from the
  file's __metadata__["n_head"].
--tokens: an llm.c token shard: 256 int32 header (magic 20240520, version 1,
  token count at index 2), then uint16 tokens. The batch is the first
  B*(T+1) tokens cut into B rows of T+1 (--layout rows, the default): row b
  has inputs row[:-1], targets row[1:]. --layout contiguous instead takes the
  first B*T+1 tokens as llm.c's loader does (inputs buf[:-1], targets buf[1:],
  both viewed as [B, T]).
Prints {"loss": ..., ...} on one line. With --expect, exits 1 when
|loss - expect| > rtol * |expect|.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_reference as ref  # noqa: E402

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256


def read_shard_tokens(path, count):
    """First `count` tokens of an llm.c .bin shard, as int64."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
        if header.size != HEADER_INTS:
            sys.exit(f"error: {path}: shorter than the {HEADER_INTS * 4}-byte shard header")
        if header[0] != SHARD_MAGIC:
            sys.exit(f"error: {path}: magic {header[0]}, expected {SHARD_MAGIC} (llm.c token shard)")
        if header[1] != SHARD_VERSION:
            sys.exit(f"error: {path}: version {header[1]}, only version {SHARD_VERSION} (uint16 tokens) is supported")
        n = int(header[2])
        if n < count:
            sys.exit(f"error: {path}: holds {n} tokens, the batch needs {count}")
        tokens = np.frombuffer(f.read(count * 2), dtype="<u2")
        if tokens.size != count:
            sys.exit(f"error: {path}: header says {n} tokens but the file ends after {tokens.size}")
    return torch.from_numpy(tokens.astype(np.int64))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model.safetensors (HF GPT-2 names)")
    ap.add_argument("--tokens", required=True, help="llm.c .bin token shard")
    ap.add_argument("--batch", type=int, required=True, help="B")
    ap.add_argument("--seq", type=int, required=True, help="T")
    ap.add_argument("--n-head", type=int, default=None, help="default: __metadata__['n_head'] of the file")
    ap.add_argument("--layout", choices=["rows", "contiguous"], default="rows")
    ap.add_argument("--expect", type=float, default=None, help="expected loss")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--double", action="store_true", help="evaluate in float64")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.batch <= 0 or args.seq <= 0:
        sys.exit(f"error: --batch {args.batch} and --seq {args.seq} must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = torch.float64 if args.double else torch.float32
    try:
        model, ignored, _ = ref.model_from_safetensors(args.model, args.n_head, dtype)
    except (KeyError, ValueError, OSError) as e:
        msg = str(e).strip("'\"")
        sys.exit(f"error: {msg}" if args.model in msg else f"error: {args.model}: {msg}")
    cfg = model.cfg
    B, T = args.batch, args.seq
    if T > cfg.n_positions:
        sys.exit(f"error: --seq {T} exceeds the checkpoint's {cfg.n_positions} positions (wpe rows)")

    if args.layout == "rows":
        buf = read_shard_tokens(args.tokens, B * (T + 1)).view(B, T + 1)
        inputs, targets = buf[:, :-1], buf[:, 1:]
    else:
        buf = read_shard_tokens(args.tokens, B * T + 1)
        inputs, targets = buf[:-1].view(B, T), buf[1:].view(B, T)
    if int(buf.max()) >= cfg.vocab_size:
        sys.exit(f"error: {args.tokens}: token id {int(buf.max())} >= vocab_size {cfg.vocab_size}")

    with torch.no_grad():
        loss = ref.forward_loss(model, inputs, targets).item()
    out = {"loss": loss, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
           "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "batch": B, "seq": T,
           "layout": args.layout, "ignored_keys": ignored}
    ok = True
    if args.expect is not None:
        ok = abs(loss - args.expect) <= args.rtol * abs(args.expect)
        out.update({"expect": args.expect, "rtol": args.rtol,
                    "rel_diff": abs(loss - args.expect) / abs(args.expect) if args.expect else None, "ok": ok})
    print(json.dumps(out))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
