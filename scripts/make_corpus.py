#!/usr/bin/env python3
"""Write the King James Bible (Debian's bible-kjv package) as a plain-text corpus.

One document per chapter: a title line ("Genesis 1") and one line per verse, with
documents separated by a blank line, which is how titan-train's plain-text reader
splits documents.
"""
import argparse
import re
import subprocess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    raw = subprocess.run(["bible", "-l1000000", "Ge1:1-Re22:21"], check=True,
                         capture_output=True, text=True).stdout
    docs, cur, verse = [], [], None
    for line in raw.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            if verse is not None:
                cur.append(verse)
            verse = m.group(1) + " " + m.group(2).strip()
        elif line.startswith(" ") and verse is not None:
            verse += " " + line.strip()
        else:  # a chapter title such as "Genesis 1"
            if verse is not None:
                cur.append(verse)
                verse = None
            if cur:
                docs.append("\n".join(cur))
            cur = [line.strip()]
    if verse is not None:
        cur.append(verse)
    if cur:
        docs.append("\n".join(cur))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n\n".join(docs) + "\n")
    print(f"[make_corpus] {len(docs)} chapters -> {args.out}")


if __name__ == "__main__":
    main()
