"""Free-text instruction rows from the Python standard library's own docstrings, in FlowerTune's columns
(`instruction`, `input`, `output`): a real, offline instruction set for trying the free-text challenges of
`recipes/flowertune.py` (or any free-text task) without the Hub.

    python examples/docstring_rows.py rows.jsonl
    python recipes/flowertune.py --challenge general --data rows.jsonl --no-load-in-4bit \\
        --base-model HuggingFaceTB/SmolLM2-135M-Instruct ...

Each public function, class and method of a fixed list of modules with a docstring becomes one row: the
instruction asks what it does, the input is its signature, the output is the docstring's first paragraph
(whitespace folded, at most 400 characters, cut at a sentence end where one is near). The rows follow the
Python version's own docstrings, so they differ a little between Python versions; their order is sorted.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "copy", "csv", "datetime", "decimal",
           "difflib", "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html",
           "inspect", "ipaddress", "itertools", "json", "logging", "math", "operator", "os", "os.path", "pathlib",
           "pprint", "random", "re", "secrets", "shlex", "shutil", "statistics", "string", "struct", "tarfile",
           "tempfile", "textwrap", "threading", "time", "typing", "unicodedata", "urllib.parse", "uuid", "zipfile")
MAX_ANSWER = 400


def first_paragraph(doc: str) -> str:
    """The docstring's first paragraph, whitespace folded, cut near MAX_ANSWER characters at a sentence end."""
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    if len(text) <= MAX_ANSWER:
        return text
    cut = text[:MAX_ANSWER]
    end = max(cut.rfind(". "), cut.rfind(".\n"))
    return cut[:end + 1] if end > MAX_ANSWER // 3 else cut.rsplit(" ", 1)[0]


def signature(obj, name: str) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # builtins without a text signature
        return f"{name}(...)"


def rows() -> list[dict[str, str]]:
    """One row per documented public callable of MODULES (and the methods of their classes), sorted."""
    out = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) is None:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{m}", f) for m, f in vars(obj).items()
                            if not m.startswith("_") and callable(f)]
            for qualname, member in members:
                doc = inspect.getdoc(member)
                answer = first_paragraph(doc) if doc else ""
                if len(answer.split()) < 4 or not re.search(r"[A-Za-z]", answer):
                    continue
                key = f"{module_name}.{qualname}"
                out.setdefault(key, {
                    "instruction": f"What does `{key}` in Python's standard library do?",
                    "input": signature(member, qualname.rsplit(".", 1)[-1]),
                    "output": answer})
    return [out[k] for k in sorted(out)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the jsonl file to write")
    args = parser.parse_args(argv)
    data = rows()
    args.output.write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"{len(data)} rows from {len(MODULES)} modules (Python {sys.version.split()[0]}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
