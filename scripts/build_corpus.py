"""Rebuild the embedded default corpus, ``lightning_parallel/data/corpus/python_docs.txt.gz``.

The corpus is real English prose that every Python install carries: the docstrings of the pure-Python modules of
CPython's standard library (PSF licence), in a fixed order. It is committed so every machine trains on the same
bytes; this script documents where it came from and regenerates it:

    python scripts/build_corpus.py [--max-bytes 1500000]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import sysconfig
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "lightning_parallel" / "data" / "corpus" / "python_docs.txt.gz"
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo"}


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80 and doc.isascii():
                out.append(textwrap.dedent(doc).strip())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-bytes", type=int, default=1_500_000)
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    size = 0
    for path in sorted(stdlib.rglob("*.py")):
        if SKIP_PARTS & set(path.relative_to(stdlib).parts):
            continue
        for doc in docstrings(path):
            chunks.append(doc)
            size += len(doc) + 2
        if size >= args.max_bytes:
            break
    text = "\n\n".join(chunks)[: args.max_bytes] + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:
        f.write(text.encode("ascii"))
    print(f"wrote {OUT} ({len(text):,} bytes of text, {OUT.stat().st_size:,} compressed)")


if __name__ == "__main__":
    main()
