#!/usr/bin/python3
"""Rewrites the "## Keys" section of docs/config.md from `lattice train --help-config`,
so the documented keys, defaults, ranges and meanings are the parser's own.

    tools/config_tables.py [--lattice build/lattice] [--doc docs/config.md] [--check]

--check rewrites nothing and exits 1 when the document is out of date (CTest runs it).
"""
import argparse
import re
import subprocess


def tables(help_text):
    out, section = [], None
    for line in help_text.splitlines():
        m = re.match(r"^\[(\w+)\]$", line)
        if m:
            section = m.group(1)
            out += ["", f"### [{section}]", "", "| key | default | valid values | meaning |", "|---|---|---|---|"]
            continue
        m = re.match(r"^  (\w+) = (.*?)\s{2,}(.*?) \[(.*)\]$", line)
        if m and section:
            key, default, meaning, valid = m.groups()
            out.append(f"| `{key}` | `{default}` | {valid} | {meaning} |")
    return "\n".join(out).strip() + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lattice", default="build/lattice")
    ap.add_argument("--doc", default="docs/config.md")
    ap.add_argument("--check", action="store_true", help="only report whether the document is up to date")
    a = ap.parse_args()
    text = subprocess.run([a.lattice, "train", "--help-config"], check=True, capture_output=True, text=True).stdout
    doc = open(a.doc).read()
    start = doc.index("## Keys\n") + len("## Keys\n")
    end = doc.index("## In code")
    new = doc[:start] + "\n" + tables(text) + "\n" + doc[end:]
    if a.check:
        if new != doc:
            raise SystemExit(f"{a.doc} is out of date with `lattice train --help-config`: run tools/config_tables.py")
        return
    open(a.doc, "w").write(new)


if __name__ == "__main__":
    main()
