#!/usr/bin/env python3
"""Rooms of a readable size: lists non-test Rust files over 600 lines and functions over 120 lines.

Usage: scripts/room-sizes.py [--exclude CRATE]... [--files N] [--fns N] [PATH]...

A file's non-test part is the lines before its first top-level `#[cfg(test)]`; files under a `tests/`,
`benches/` or `examples/` folder, and files named `tests.rs` or under a `tests/` module folder, are tests and
are skipped. A function is counted from its `fn` line to the line of its closing brace, both included; its
body is found by matching braces after comments, strings and character literals are blanked out, so a brace
in a string or a comment does not count. Exit status: 0 when nothing is over, 1 when something is, 2 on
bad usage.
"""

import os
import re
import sys

FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def blank(src):
    """The source with comments, strings and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', src[i:i + 300])) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the former is blanked.
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", src[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def non_test_part(src):
    m = re.search(r"^#\[cfg\(test\)\]", src, re.M)
    return src if m is None else src[: m.start()]


def functions(code):
    """(name, first line, line count) of every function with a body."""
    found = []
    for m in FN.finditer(code):
        # The body opens at the first `{` after the signature, unless a `;` ends a bodiless declaration first.
        i, depth_paren = m.end(), 0
        while i < len(code):
            ch = code[i]
            if ch in "([":
                depth_paren += 1
            elif ch in ")]":
                depth_paren -= 1
            elif ch == ";" and depth_paren == 0:
                i = -1
                break
            elif ch == "{" and depth_paren == 0:
                break
            i += 1
        if i < 0 or i >= len(code):
            continue
        depth, j = 0, i
        while j < len(code):
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, j) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def is_test_path(path):
    parts = path.split(os.sep)
    return any(p in ("tests", "benches", "examples") for p in parts[:-1]) or parts[-1] == "tests.rs"


def main(argv):
    excludes, roots, max_file, max_fn = [], [], 600, 120
    args = iter(argv)
    for a in args:
        if a == "--exclude":
            excludes.append(next(args, ""))
        elif a == "--files":
            max_file = int(next(args, "600"))
        elif a == "--fns":
            max_fn = int(next(args, "120"))
        elif a.startswith("-"):
            print(__doc__, file=sys.stderr)
            return 2
        else:
            roots.append(a)
    roots = roots or ["crates"]
    over = 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "target" and d not in excludes)
            for f in sorted(filenames):
                path = os.path.join(dirpath, f)
                if not f.endswith(".rs") or is_test_path(path):
                    continue
                with open(path, encoding="utf-8") as fh:
                    src = non_test_part(fh.read())
                lines = src.count("\n")
                if lines > max_file:
                    print(f"{path}: {lines} non-test lines (over {max_file})")
                    over += 1
                for name, first, count in functions(blank(src)):
                    if count > max_fn:
                        print(f"{path}:{first}: fn {name}: {count} lines (over {max_fn})")
                        over += 1
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
