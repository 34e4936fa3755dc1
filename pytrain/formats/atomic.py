"""Writes that never leave a truncated file under the final name.

Everything pytrain saves (adapters, PEFT folders, checkpoints, merged models) goes through
here: a temporary file next to the target, fsync, rename, fsync of the folder.  A crash or a
full disk at any moment leaves the previous file intact.
"""
from __future__ import annotations

import errno
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def new_temp_file(p: Path) -> Path:
    """An empty, exclusively created file next to ``p``.  Unlike ``mkstemp`` (mode 0600) it
    gets the umask's permissions, so the renamed file is as readable as a plain write."""
    for _ in range(100):
        tmp = p.parent / f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise OSError(f"{p}: cannot create a temporary file in {p.parent}")


def named(e: OSError, path: str | os.PathLike, tmp: Path | None = None) -> OSError:
    """``e``, a failed write, naming the file it was for: ``path`` where ``e`` names no file
    (a failed ``write`` or ``fsync``: a full disk is "[Errno 28] No space left on device" and
    nothing more) or the temporary ``tmp`` (file, or folder: its file under ``path``); any
    other file ``e`` names is its own, and ``e`` is returned as it is.  numpy's short write
    ("1024 requested and 0 written", without errno) gets its likely cause, when one shows."""
    p, where = Path(path), e.filename
    if where is not None:
        if tmp is None:
            return e
        f = Path(os.fsdecode(where))
        if f == tmp:
            where = p
        elif tmp in f.parents:
            where = p / f.relative_to(tmp)
        else:
            return e
    else:
        where = p
    if e.errno is not None:
        new = OSError(e.errno, e.strerror or os.strerror(e.errno), str(where))
    else:
        code = _short_write_cause(Path(where))
        new = OSError(code, f"{os.strerror(code)} ({e})", str(where)) if code else OSError(str(e))
        new.filename = str(where)
    return new


def _raise_named(e: BaseException, path: Path, tmp: Path | None = None) -> None:
    """Raise ``e`` again (in an ``except`` block), an OSError as ``named`` names it."""
    new = named(e, path, tmp) if isinstance(e, OSError) else e
    if new is e:
        raise e
    raise new from e


def _short_write_cause(path: Path) -> int | None:
    """Why a write came short, when this process can tell: the file size limit (``ulimit
    -f``) or a full disk."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            return errno.EFBIG
    except (ImportError, OSError, ValueError):
        pass
    try:
        st = os.statvfs(path.parent)
        if st.f_bavail * st.f_frsize < 2**20:
            return errno.ENOSPC
    except OSError:
        pass
    return None


def fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable (some filesystems cannot fsync a folder: ignored)."""
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """``with replacing(p) as tmp: write tmp`` — on success tmp is fsync'ed and renamed over
    ``p``; on any exception it is removed and ``p`` is untouched."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_temp_file(p)
    except OSError as e:
        _raise_named(e, p)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _raise_named(e, p, tmp)
    fsync_dir(p.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system
    or filesystem cannot."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def restore_folder(path: str | os.PathLike) -> bool:
    """Finish what a killed ``replacing_folder`` left where it could not swap in one step: the
    old folder moved aside (``.NAME.HEX.old``) and the process gone before the new one was
    renamed in.  The old one goes back (the write did not happen, as for any failed write);
    an aside folder left beside a ``p`` in place (killed while deleting it) goes.  True when
    a folder was put back.  Readers and the next write call this."""
    import shutil
    p = Path(path)
    olds = sorted(p.parent.glob(f".{p.name}.*.old"), key=lambda q: q.stat().st_mtime)
    restored = False
    if olds and not p.exists():
        os.replace(olds.pop(), p)
        fsync_dir(p.parent)
        restored = True
    for q in olds:
        shutil.rmtree(q, ignore_errors=True)
    return restored


@contextmanager
def replacing_folder(path: str | os.PathLike) -> Iterator[Path]:
    """``with replacing_folder(p) as tmp: write files into tmp`` — on success every file is
    fsync'ed and the folder takes ``p``'s place as a unit: swapped with the old one in one
    rename where Linux allows it (a reader sees the old folder or the new one, never a mix of
    their files), else the old one moved aside and then the new one renamed in (a process
    killed between the two renames leaves the old one aside: ``restore_folder``, which readers
    and the next write call, puts it back).  On any exception ``p`` is untouched."""
    import shutil
    import tempfile
    p = Path(path)
    restore_folder(p)
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"{p}: exists and is not a folder")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
    try:
        tmp.chmod(0o777 & ~_umask())
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if not p.exists():
            os.replace(tmp, p)
        elif _exchange(tmp, p):          # tmp now holds the old folder
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            aside = p.parent / f".{p.name}.{secrets.token_hex(4)}.old"
            os.replace(p, aside)
            os.replace(tmp, p)
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_named(e, p, tmp)
    fsync_dir(p.parent)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
