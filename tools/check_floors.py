#!/usr/bin/env python3
"""The floors of src/lattice: every include points down, never up or sideways.

    tools/check_floors.py [SRC_DIR]      (default: src/lattice beside this file)

The folders and what each may include besides itself (the line of
dependencies written in src/lattice/CMakeLists.txt):

    cli -> train -> parallel -> optim -> model -> layers -> {kernels, comm} -> core
    train -> data -> io -> core, and parallel -> io
    cli -> plan -> parallel (the planner reads schedules and ZeRO's layout)

The engines in parallel/ wrap the model; the layers in layers/ build it. Inside
parallel/, the pipeline engine and the data-parallel engine (data/, zero/,
compress/) never include each other: the trainer wires them together. And no
two files include each other, directly or through others (a cycle).

Prints each violation on a line of its own and exits 1, or prints a summary and
exits 0. CTest runs it (tests/tree).
"""
import os
import re
import sys

# What each top folder may include, besides itself.
ALLOWED = {
    "core": set(),
    "kernels": {"core"},
    "comm": {"core"},
    "layers": {"kernels", "comm", "core"},
    "model": {"layers", "kernels", "comm", "core"},
    "optim": {"model", "layers", "kernels", "comm", "core"},
    "data": {"io", "core"},
    "io": {"core"},
    "parallel": {"optim", "model", "layers", "kernels", "comm", "io", "core"},
    "plan": {"parallel", "optim", "model", "layers", "kernels", "comm", "io", "core"},
    "train": {"plan", "parallel", "optim", "data", "io", "model", "layers", "kernels", "comm", "core"},
    "cli": {"train", "plan", "parallel", "optim", "data", "io", "model", "layers", "kernels", "comm", "core"},
}
# Inside parallel/: sub-folders that must not include each other.
APART = [({"pipeline"}, {"data", "zero", "compress"})]

INCLUDE = re.compile(r'^\s*#\s*include\s+["<]lattice/([^">]+)[">]', re.M)


def folder(path):
    """('parallel', 'data') for 'parallel/data/x.h'; ('core', None) for 'core/x.h'."""
    parts = path.split("/")
    sub = parts[1] if len(parts) > 2 else None
    return parts[0], sub


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "src", "lattice")
    src = os.path.normpath(src)
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith((".h", ".cpp")):
                rel = os.path.relpath(os.path.join(root, n), src).replace(os.sep, "/")
                with open(os.path.join(root, n), encoding="utf-8") as f:
                    files[rel] = INCLUDE.findall(f.read())
    problems = []
    for rel, includes in sorted(files.items()):
        top, sub = folder(rel)
        if top not in ALLOWED:
            problems.append(f"{rel}: folder '{top}' has no floor in tools/check_floors.py")
            continue
        for inc in includes:
            itop, isub = folder(inc)
            if itop != top and itop not in ALLOWED[top]:
                problems.append(f"{rel}: includes lattice/{inc}: {top}/ may not include {itop}/ (an upper floor)")
            if top == itop == "parallel" and sub != isub:
                for a, b in APART:
                    if (sub in a and isub in b) or (sub in b and isub in a):
                        problems.append(f"{rel}: includes lattice/{inc}: parallel/{sub}/ and parallel/{isub}/ "
                                        "never include each other (the trainer wires them)")
            if inc not in files:
                problems.append(f"{rel}: includes lattice/{inc}, which does not exist")
    # Cycles between files (including a header including its own .cpp's header is fine: a .cpp is never included).
    state = {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in files.get(node, []):
            if nxt not in files:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                problems.append("include cycle: " + " -> ".join(cycle))
            elif state.get(nxt) is None:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for f in sorted(files):
        if state.get(f) is None:
            visit(f, [])
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"floors: {len(files)} files, {sum(len(v) for v in files.values())} includes, every one points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
