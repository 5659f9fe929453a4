"""All-or-nothing writes: a file replaced atomically, a folder built beside its target and swapped in."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
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


def built_once(path: Path, build: Callable[[Path], None]) -> Path:
    """A cache folder: `path` if it exists, else `build(tmp)` into a temp folder beside it renamed into
    place (a killed build never leaves a partial folder behind; a concurrent builder's copy wins)."""
    path = Path(path)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


LOCK_FILE = ".hf_fedtask.lock"
CHECKPOINT_FILE = "checkpoint.safetensors"  # a run folder's checkpoint (`hf_fedtask.core.checkpoint`), named here
# so that the run folder's checks (`hf_fedtask.engine.preflight`) read it without importing torch


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "run folder") -> Iterator[Path]:
    """Hold an exclusive lock on `folder` (created if missing) while the block runs: a second process
    gets one line naming the holder. The lock is the OS's (`fcntl.flock`), so it is released on any
    exit of the holder, SIGKILL included; a stale lock file is harmless. A folder this call created
    and nothing else wrote into is removed again."""
    import fcntl

    folder = Path(folder)
    created = not folder.exists()
    first_new = folder  # the outermost folder this call creates: removed again when nothing was written
    while not first_new.parent.exists() and first_new.parent != first_new:
        first_new = first_new.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputDirError(f"{folder}: cannot be used as a {what} ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            raise OutputDirError(f"{folder}: the {what} is in use by {holder}; "
                                 "wait for it or use another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({' '.join(sys.argv)[:200]})".encode(), 0)
        yield folder
    finally:
        os.close(fd)  # closing the descriptor releases the lock
        if created and [p.name for p in folder.iterdir()] == [LOCK_FILE]:  # nothing was written: leave no trace
            shutil.rmtree(first_new, ignore_errors=True)


def remove_stale_staging(folder: Path) -> list[Path]:
    """Remove the `.<name>.tmp-*` / `.<name>.old-*` folders and files a killed writer (`staged_folder`,
    `write_atomic`) left in `folder`; call it under the folder's lock, when no writer is using them."""
    removed = []
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed
