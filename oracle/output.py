"""Writing output files safely: fail before any work if the path cannot be written, write under a temporary
name beside it, and rename only when complete — an interrupted write never leaves a file that looks finished,
and never destroys the previous one."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from oracle.errors import OutputError


def check_writable(path: Path, option: str = "--out") -> None:
    """Fail early, naming `option`, if `path` cannot be created or replaced."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path} is a directory; give a file name such as {path / 'out.h5'}.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: directory {parent} does not exist; create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: directory {parent} is not writable; choose another location.")


@contextmanager
def atomic_output(path: Path, option: str = "--out") -> Iterator[Path]:
    """Yield a temporary path to write; it replaces `path` when the block completes, and is removed otherwise."""
    path = Path(path)
    check_writable(path, option)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {err}. Check free space and permissions there.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
