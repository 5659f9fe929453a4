"""All-or-nothing writes: a file replaced atomically, a folder built beside its target and swapped in."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hf_fedtask.errors import OutputDirError


def write_atomic(path: str | os.PathLike, content: str | bytes) -> None:
    """Write `content` to a temporary file next to `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """Yield an empty folder beside `out`; on success swap it in for `out` (an existing folder is
    moved aside, then deleted), on failure delete it: `out` is never half-written."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        if out.exists():
            os.replace(out, aside / out.name)
        try:
            os.replace(staging, out)
        except BaseException:
            if (aside / out.name).exists():
                os.replace(aside / out.name, out)
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
