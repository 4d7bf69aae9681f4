#!/usr/bin/python3
"""CTest `llama_reference` (label `torch`): the PyTorch Llama that lattice's
Llama parity fixtures come from (tools/llama_reference.py) is itself right,
and the committed fixtures are what it makes.

  1. its selftest: the torch model against a float64 numpy forward written
     separately (a loop per head and per position, RoPE as pairwise
     rotations, query head h reading key/value head h // (n_head/n_kv_head)),
     for 4, 2 and 1 key/value heads, tied, with biases, head_dim ≠ C/H; every
     grouped model against the plain multi-head model whose k/v weights
     repeat each key/value head; HF names, order and shapes; config.json and
     safetensors round trips and refusals;
  2. its RoPE tables (inv_freq, cos, sin) equal, bit for bit, those of
     tests/kernels/fixtures/llama_kernels.safetensors, which lattice's RoPE
     kernel is held to (HF's f32 angles; head size 16 at theta 1e4, and 128
     at theta 5e5 up to position 8191, where an f64-computed inv_freq differs);
  3. per fixture (tests/model/fixtures/llama_kv{4,2,1}/):
     - config.json (HF keys) and expected.json's "model" (lattice keys) agree;
     - re-running the recipe gives init.safetensors bit for bit and the
       per-step losses, grad norms and final parameters of the files;
     - `eval` (the command line, in-process) on final.safetensors: the mean of
       the per-row losses of each micro-batch is expected.json's
       loss_after_final; with the repeated-k/v multi-head model the same;
     - `generate` (greedy, no cache) on final.safetensors: every token is the
       argmax of one causal forward over the prompt and the tokens before it,
       and past max_position_embeddings the argmax over the sliding window;
  4. the command line through a real process once (eval's JSON, and the
     error when DIR/model.safetensors is missing).

    /usr/bin/python3 tests/model/llama_reference_test.py [--tools DIR] [--fixtures DIR]

Exit 0: pass; 1: failure; 77: skipped (torch cannot be imported).
"""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def rel(a, b):
    return abs(a - b) / abs(b)


def cli(ref, args):
    """Runs llama_reference.py's main() in this process; returns its JSON output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ref.main(args)
    check(rc == 0, f"llama_reference.py {' '.join(args)} returned {rc}")
    return json.loads(out.getvalue())


def check_rope_tables(ref, torch, path):
    t, meta = ref.safetensors_lite.load_torch(path)
    hs, theta = int(meta["rope.head_size"]), float(meta["rope.theta"])
    cos, sin = ref.rope_cos_sin(hs, theta, int(meta["rope.max_positions"]), torch.float32)
    check(torch.equal(ref.rope_inv_freq(hs, theta), t["rope.inv_freq"]), "rope.inv_freq differs")
    check(torch.equal(cos, t["rope.cos"]) and torch.equal(sin, t["rope.sin"]), "rope.cos/sin differ")
    hs, theta = int(meta["rope_table.head_size"]), float(meta["rope_table.theta"])
    positions = t["rope_table.positions"].long()
    cos, sin = ref.rope_cos_sin(hs, theta, int(positions.max()) + 1, torch.float32)
    check(torch.equal(ref.rope_inv_freq(hs, theta), t["rope_table.inv_freq"]), "rope_table.inv_freq differs")
    check(torch.equal(cos[positions], t["rope_table.cos"]) and torch.equal(sin[positions], t["rope_table.sin"]),
          "rope_table.cos/sin differ")
    print(f"  RoPE tables equal {os.path.basename(path)}'s")


def check_fixture(ref, fixture_maker, recipe, torch, d):
    name = os.path.basename(d)
    expected = json.load(open(os.path.join(d, "expected.json")))
    cfg = ref.read_config(os.path.join(d, "config.json"))
    check(expected["model"] == fixture_maker.lattice_model_keys(cfg),
          f"{name}: expected.json model {expected['model']} does not describe config.json {cfg}")
    check(cfg == fixture_maker.config_of(cfg.n_kv_head), f"{name}: config.json is not the script's config")

    # The files are what the reference makes now.
    tokens = recipe.make_tokens()
    batch, _ = ref.safetensors_lite.load_torch(os.path.join(d, "batch.safetensors"))
    check(torch.equal(batch["tokens"], tokens.float()), f"{name}: batch.safetensors differs from the recipe's")
    rec, model, grads = fixture_maker.run(cfg, torch.float32, tokens)
    for s in range(recipe.STEPS):
        check(rel(rec["loss"][s], expected["loss"][s]) < 1e-6, f"{name}: step {s} loss {rec['loss'][s]} vs "
              f"{expected['loss'][s]}")
        check(rel(rec["grad_norm"][s], expected["grad_norm"][s]) < 1e-5, f"{name}: step {s} grad norm")
    clipped = [st["clipped"] for st in expected["steps"]]
    check(any(clipped) and not all(clipped), f"{name}: clipping should act on some steps, not all: {clipped}")
    init = ref.build_model(cfg)
    ref.init_params(init, seed=fixture_maker.PARAM_SEED)
    files = {f: ref.safetensors_lite.load_torch(os.path.join(d, f))[0]
             for f in ("init.safetensors", "grads_step1.safetensors", "final.safetensors")}
    for n, p in init.named_parameters():
        check(torch.equal(p.detach(), files["init.safetensors"][n]), f"{name}: init {n} differs")
    for n, p in model.named_parameters():
        check((grads[n] - files["grads_step1.safetensors"][n]).abs().max().item() < 1e-9, f"{name}: grad {n}")
        check((p.detach() - files["final.safetensors"][n]).abs().max().item() < 3e-4, f"{name}: final {n}")

    # eval on the final weights reproduces loss_after_final, row by row.
    final = os.path.join(d, "final.safetensors")
    loaded = ref.load_dir(d, final)
    mha = ref.mha_equivalent(loaded)
    for m in range(recipe.GRAD_ACCUM):
        rows = [row.tolist() for row in tokens[m]]
        losses = [cli(ref, ["eval", "--model", d, "--weights", final, "--tokens", ",".join(map(str, r))])["loss"]
                  for r in rows]
        want = expected["loss_after_final"]["micro_losses"][m]
        got = sum(losses) / len(losses)
        check(rel(got, want) < 2e-6, f"{name}: micro-batch {m}: eval gives {got}, loss_after_final {want}")
        got_mha = sum(ref.sequence_loss(mha, r) for r in rows) / len(rows)
        check(rel(got_mha, got) < 2e-6, f"{name}: repeated-k/v multi-head model gives {got_mha}, grouped {got}")
        print(f"  {name} micro-batch {m}: eval {got:.9f}, loss_after_final {want:.9f}, mha {got_mha:.9f}")

    # generate: greedy tokens agree with one causal forward over the whole context.
    Tmax = cfg.max_positions
    for prompt_len, n in ((3, 9), (10, 12)):
        prompt = tokens[0][1][:prompt_len].tolist()
        new = cli(ref, ["generate", "--model", d, "--weights", final, "--prompt", ",".join(map(str, prompt)),
                        "--n", str(n)])["tokens"]
        check(len(new) == n and all(0 <= t < cfg.vocab_size for t in new), f"{name}: generate gave {new}")
        context = prompt + new
        with torch.no_grad():
            # within max_position_embeddings: one forward, position i predicts token i+1
            k = min(len(context) - 1, Tmax)
            logits = loaded(torch.tensor(context[:k])[None, :])[0]
            for i in range(prompt_len - 1, k):
                check(ref.argmax_lowest(logits[i]) == context[i + 1],
                      f"{name}: generated token {i + 1 - prompt_len} is not the argmax at position {i}")
            # past it: the window of the last Tmax tokens
            for i in range(max(k, prompt_len - 1), len(context) - 1):
                window = context[i + 1 - Tmax:i + 1]
                last = loaded(torch.tensor(window)[None, :])[0, -1]
                check(ref.argmax_lowest(last) == context[i + 1], f"{name}: windowed token at {i + 1}")
        print(f"  {name} generate prompt {prompt} -> {new}")
    check(len(set(new)) > 1, f"{name}: generate gave one token over and over ({new}); a weak check")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", default=os.path.join(HERE, "..", "..", "tools"))
    ap.add_argument("--fixtures", default=os.path.join(HERE, "fixtures"))
    ap.add_argument("--kernel-fixture", default=os.path.join(HERE, "..", "kernels", "fixtures",
                                                             "llama_kernels.safetensors"))
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"SKIP: PyTorch cannot be imported ({e}); install python3-torch and run /usr/bin/python3")
        return SKIP
    sys.path.insert(0, os.path.abspath(args.tools))
    import llama_reference as ref
    import make_llama_parity_fixture as fixture_maker
    import make_parity_fixture as recipe
    torch.set_num_threads(1)

    ref._selftest()
    check_rope_tables(ref, torch, args.kernel_fixture)
    dirs = [os.path.join(args.fixtures, f"llama_kv{kv}") for kv in fixture_maker.KV_HEADS]
    for d in dirs:
        check_fixture(ref, fixture_maker, recipe, torch, d)

    # The real entry point once: a process, its exit code and its JSON.
    row = recipe.make_tokens()[1][2].tolist()
    out = subprocess.run([sys.executable, os.path.join(args.tools, "llama_reference.py"), "eval", "--model", dirs[1],
                          "--weights", os.path.join(dirs[1], "final.safetensors"), "--tokens",
                          ",".join(map(str, row))], capture_output=True, text=True, check=True).stdout
    model = ref.load_dir(dirs[1], os.path.join(dirs[1], "final.safetensors"))
    check(json.loads(out) == {"loss": ref.sequence_loss(model, row)}, f"eval printed {out!r}")
    bad = subprocess.run([sys.executable, os.path.join(args.tools, "llama_reference.py"), "eval", "--model", dirs[1],
                          "--tokens", "1,2"], capture_output=True, text=True)
    check(bad.returncode != 0 and "model.safetensors" in bad.stderr,
          f"eval without DIR/model.safetensors: rc {bad.returncode}, stderr {bad.stderr!r}")
    print("llama_reference: all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
