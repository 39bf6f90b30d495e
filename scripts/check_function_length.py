#!/usr/bin/env python3
"""Fails when a function in the product sources (app/, core/, models/, moe/, parallel/) has a
body longer than --max lines (default 100): long functions hide structure (docs/design.md).

A small brace scanner, not a C++ parser: it skips comments, strings and character literals,
treats namespace/class/struct/enum/union bodies as containers, and measures every other
top-level brace block whose header looks like a function (it has a parameter list and is
not a control statement or an initializer). Lambdas count towards their enclosing function.
"""
import argparse
import os
import re
import sys

CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b[^;()]*$")
CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|try)\b")


def strip_code(text):
    """Blanks comments and literals, keeping newlines so line numbers stay right."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """Yields (header, first_line, body_lines) for each top-level function body."""
    code = strip_code(text)
    stack = []  # per open brace: 'container', 'function' or 'other'
    header_start = 0
    line = 1
    fn_start = None
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c == "{":
            header = code[header_start:i].strip()
            inside_fn = any(k == "function" for k, _ in stack)
            if inside_fn:
                kind = "other"
            elif CONTAINER.search(header.split("\n")[-1] if header else "") or header.endswith(
                    "extern \"C\""):
                kind = "container"
            elif "(" in header and not CONTROL.match(header) and not header.rstrip().endswith("="):
                kind = "function"
                fn_start = (header, line)
            else:
                kind = "other"
            stack.append((kind, line))
            header_start = i + 1
        elif c == "}":
            if stack:
                kind, start = stack.pop()
                if kind == "function":
                    yield fn_start[0], start, line - start - 1
            header_start = i + 1
        elif c == ";" and not any(k == "function" for k, _ in stack):
            header_start = i + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=100)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    a = ap.parse_args()
    bad = 0
    for folder in ("app", "core", "models", "moe", "parallel"):
        for dirpath, _, files in os.walk(os.path.join(a.root, folder)):
            for f in sorted(files):
                if not f.endswith((".cpp", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                for header, start, n in functions(text):
                    if n > a.max:
                        name = re.sub(r"\s+", " ", header.split("(")[0]).split(" ")[-1]
                        rel = os.path.relpath(path, a.root)
                        print(f"function length: {rel}:{start}: {name} has {n} lines; "
                              f"allowed: at most {a.max}")
                        bad += 1
    if bad == 0:
        print(f"function length: every product function is at most {a.max} lines")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
