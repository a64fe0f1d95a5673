"""Writing output files safely: fail before any work if the path cannot be written or is one of the command's
inputs, write under a temporary name beside it, and rename only when complete — an interrupted or failed write
(Ctrl-C, a full disk) never leaves a file that looks finished, never leaves its temporary file, and never destroys
the previous one."""

import errno
import os
import re
import signal
import stat
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from oracle.errors import OutputError

# errno values that mean "the disk (or a quota, or RLIMIT_FSIZE) has no room for this file"
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_writable(path: Path, option: str = "--out") -> None:
    """Fail early, naming `option`, if `path` cannot be created or replaced: checked before the work, so a result
    is never followed by a failed write. Beyond permissions: an existing output must be a regular file (the rename
    would replace /dev/null or a FIFO), and atomic_output's temporary file must really be creatable beside it
    (/proc, /sys and read-only mounts pass os.access but refuse it)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path} is a directory; give a file name such as {path / 'out.h5'}.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: directory {parent} does not exist; create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: directory {parent} is not writable; choose another location.")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # absent: created by the write
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{option} {path} exists and is not a regular file (a device, FIFO or socket); writing "
                          f"the output would replace it. Choose a file name.")
    trial = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # the name atomic_output writes, removed at once
    try:
        _create_and_remove(trial)
    except FileExistsError:
        pass  # this process's own pending write: creatable
    except OSError as err:
        raise OutputError(f"{option} {path}: a file cannot be created in {parent} ({err.strerror}), so it cannot "
                          f"write {path}; choose another location.") from None


def _create_and_remove(trial: Path) -> None:
    """Create `trial` and remove it again. An interrupt between the two removes it too: it is pending from before
    it exists (a SIGTERM there had left the trial file beside --out)."""
    if trial in _PENDING:
        raise FileExistsError(trial)  # atomic_output is writing it now
    with removed_on_interrupt(trial):
        os.close(os.open(trial, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
        os.unlink(trial)


def refuse_overwriting_inputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse (OutputError, naming both) an output that is one of the command's inputs, or another output.

    `outputs` maps an option (e.g. "--out") to its path; `inputs` maps a label (e.g. "checkpoint") to a file, or to
    a directory whose files are all inputs (a checkpoint, a raw trace directory). Two paths are the same file when
    their resolved paths are equal (symlinks) or when both exist with the same device and inode (hard links);
    None entries are skipped. Inside `published_at_end` (every CLI command), `outputs` are the command's outputs:
    they are put in place when it ends."""
    known: list[tuple[str, Path]] = []
    for label, path in inputs.items():
        if path is None:
            continue
        path = Path(path)
        known.append((label, path))
        if path.is_dir():
            known += [(f"{label} file {entry.name}", Path(entry.path)) for entry in _files_in(path)]
    for option, path in outputs.items():
        if path is None:
            continue
        declare_outputs(path)
        for label, other in known:
            if _same_file(Path(path), other):
                raise OutputError(f"{option} {path} is the {label} ({other}): writing it would destroy an input "
                                  f"of this command. Choose another output path.")
        known.append((f"output of {option}", Path(path)))
    _refuse_changing_a_checkpoint(outputs, inputs)


# Names the checkpoint reader interprets in a checkpoint's folder (oracle/checkpoint.py, oracle/gguf_source.py).
CHECKPOINT_NAMES = ("config.json", "model.safetensors.index.json", "gguf_source.json")
CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")


def _refuse_changing_a_checkpoint(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """An output created in an input checkpoint's folder under a name the checkpoint reader reads would change what
    the folder means afterwards (a `.safetensors` beside a GGUF makes its folder read as a safetensors checkpoint;
    a config.json beside it overrides its metadata): refused (OutputError), new file or not."""
    folders = {}
    for label, path in inputs.items():
        folder = _checkpoint_folder(Path(path)) if path is not None else None
        if folder is not None:
            folders[folder] = label
    for option, path in outputs.items():
        if path is None or not (Path(path).name in CHECKPOINT_NAMES or Path(path).suffix in CHECKPOINT_SUFFIXES):
            continue
        label = folders.get(_resolved(Path(path).parent))
        if label is not None:
            raise OutputError(f"{option} {path} would be written into the folder of the {label} under a name the "
                              f"checkpoint reader reads, which would change what that checkpoint means afterwards. "
                              f"Write it to another folder or under another name.")


def _checkpoint_folder(path: Path) -> Path | None:
    """The resolved folder of a checkpoint input: the folder itself, or a GGUF file's folder; else None."""
    if path.suffix == ".gguf" and path.is_file():
        return _resolved(path.parent)
    if path.is_dir() and any((path / n).exists() for n in CHECKPOINT_NAMES[:2]) or path.is_dir() and any(
            e.name.endswith(CHECKPOINT_SUFFIXES) for e in _files_in(path)):
        return _resolved(path)
    return None


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def _files_in(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return [e for e in entries if e.is_file()]
    except OSError:
        return []  # unreadable: the command reports it when it reads the directory


def _same_file(a: Path, b: Path) -> bool:
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
    except (OSError, ValueError):
        pass
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False  # one does not exist (yet): the resolved paths were the whole answer
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


@contextmanager
def atomic_output(path: Path, option: str = "--out") -> Iterator[Path]:
    """Yield a temporary path to write; it replaces `path` when the block completes, and is removed otherwise.

    - A full disk (or quota, file size limit) or an I/O error raises OutputError ("no space left on DIR"). Errors
      that HDF5 reports only while freeing an object (Python prints them as "Exception ignored" and goes on) are
      collected, not printed, and fail the write too: a file that lost a write is never published.
    - SIGINT/SIGTERM during the block are held until it ends (an exception raised inside HDF5's close could be
      swallowed, and the run would end with exit 0 and a complete file); then the temporary file is removed and
      the signal delivered to the previous handler. A second signal is delivered at once.
    - A temporary file left beside `path` by a killed run (its process gone) is removed first.
    - Inside `published_at_end`, an output the command declared is renamed only when the command ends."""
    path = Path(path)
    check_writable(path, option)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with removed_on_interrupt(tmp), _unraisable_collected() as lost, _signals_held() as held:
        try:
            yield tmp
            if lost:
                raise lost[0]
            if held:
                raise _Interrupted()
            if _COMMAND is not None and os.path.abspath(path) in _COMMAND.declared:
                _COMMAND.staged[path] = tmp  # put in place with the command's other outputs, when it ends
            else:
                os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise OutputError(_write_error_message(path, option, err)) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


class _CommandOutputs:
    """The outputs of the command running now: declared (absolute paths), and those written, by final path, with
    the temporary file that holds each until the command ends."""

    def __init__(self):
        self.declared: set[str] = set()
        self.staged: dict[Path, Path] = {}

    def publish(self) -> None:
        """Rename every staged output into place; OutputError (the others are discarded) if one cannot be."""
        staged, self.staged = self.staged, {}
        for path, tmp in list(staged.items()):
            try:
                os.replace(tmp, path)
            except OSError as err:
                for left in staged.values():
                    Path(left).unlink(missing_ok=True)
                raise OutputError(_write_error_message(path, "output", err)) from None
            del staged[path]

    def discard(self) -> None:
        for tmp in self.staged.values():
            Path(tmp).unlink(missing_ok=True)
        self.staged = {}


_COMMAND: _CommandOutputs | None = None


@contextmanager
def published_at_end(before_publishing=lambda: None) -> Iterator[None]:
    """One command: the outputs it declares (`refuse_overwriting_inputs`) and writes (`atomic_output`) stay under
    their temporary names until the block ends, and are then renamed into place together, also when it ends with
    an error (as they were before); an interrupt (KeyboardInterrupt, or the CLIs' handler) removes them instead. So
    an interrupted command leaves every previous output as it was: a report written, then a Ctrl-C while the next
    one was drawn, had exited 130 with the first one replaced. `before_publishing()` runs just before the renames
    (the CLIs stop listening to SIGINT/SIGTERM there: the command is over)."""
    global _COMMAND
    outer, _COMMAND = _COMMAND, _CommandOutputs()
    ours = _COMMAND
    try:
        yield
    except KeyboardInterrupt:
        ours.discard()
        raise
    except BaseException:
        _COMMAND = outer
        before_publishing()
        ours.publish()
        raise
    else:
        _COMMAND = outer
        before_publishing()
        ours.publish()
    finally:
        _COMMAND = outer


def declare_outputs(*paths: Path) -> None:
    """Within `published_at_end`, make `paths` the command's outputs (`refuse_overwriting_inputs` does it for those
    it checks)."""
    if _COMMAND is not None:
        _COMMAND.declared.update(os.path.abspath(p) for p in paths)


def staged_path(path: Path) -> Path:
    """Where the command's output `path` can be read before it is put in place: its temporary file while staged."""
    return Path(_COMMAND.staged.get(Path(path), path)) if _COMMAND is not None else Path(path)


_PENDING: set[Path] = set()  # unfinished outputs and scratch directories, removed if the program is interrupted
_CHILDREN: "weakref.WeakSet" = weakref.WeakSet()  # child processes (subprocess.Popen) killed if it is interrupted


def killed_on_interrupt(proc):
    """Have `remove_pending` (the CLIs' interrupt handler) kill the child process `proc` (a subprocess.Popen) before
    the program ends, with its whole process group when it leads one (`kill_process_group`). A C library's worker
    stuck in the library's own code never returns to Python to act on a SIGINT; without this an interrupted
    `mtp-probe run` left it running. Returns `proc`."""
    _CHILDREN.add(proc)
    return proc


def kill_process_group(proc, grace: float = 0.0) -> None:
    """SIGKILL the child `proc` and, when it was started as the leader of its own process group
    (`start_new_session=True`), every process left in that group: what a library that forks left behind, which
    outlived the run and an interrupt. Also after `proc` has ended (its group may still hold its children). With
    `grace`, SIGTERM first and up to `grace` seconds to end (a compiler then removes its own temporary files).
    Never raises."""
    if grace and getattr(proc, "leads_its_group", False) and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except Exception:
            pass
    if getattr(proc, "leads_its_group", False):
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group keeps the leader's id while any member lives
        except OSError:
            pass  # none left
    try:
        proc.kill()  # a no-op for one that has ended
    except OSError:
        pass


def run_ended_with_us(cmd: list[str], grace: float, env: dict | None = None):
    """subprocess.run(cmd), text output captured, in its own process group that the program's interrupt handler
    ends with it (SIGTERM, `grace` seconds, then SIGKILL: kill_process_group), as does any exception here; a plain
    subprocess.run left the child running after a Ctrl-C or SIGTERM ended the program at once."""
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env)
    proc.leads_its_group, proc.stop_grace = True, grace
    try:
        stdout, stderr = killed_on_interrupt(proc).communicate()
    except BaseException:
        kill_process_group(proc, grace)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@contextmanager
def removed_on_interrupt(path: Path) -> Iterator[Path]:
    """While the block runs, `path` (a temporary file or directory) is removed by `remove_pending`, which the
    CLIs' interrupt handler calls before ending the process at once (oracle/errors.py)."""
    _PENDING.add(Path(path))
    try:
        yield Path(path)
    finally:
        _PENDING.discard(Path(path))


@contextmanager
def scratch_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory for the block, removed after it or, on an interrupt, by `remove_pending`. Created and
    registered, then unregistered and removed, with SIGINT/SIGTERM held: a signal between mkdtemp and the
    registration (or between the two at the end) had left it in TMPDIR (tempfile.TemporaryDirectory +
    removed_on_interrupt; seen in CI's signal trials)."""
    import shutil
    import tempfile

    path = None
    try:
        with _signals_held():  # a signal held here is delivered after the registration: the finally removes it
            path = Path(tempfile.mkdtemp(prefix=prefix))
            _PENDING.add(path)
        yield path
    finally:
        if path is not None:
            with _signals_held():
                shutil.rmtree(path, ignore_errors=True)
                _PENDING.discard(path)


def remove_pending() -> None:
    """Kill the child processes still running and remove every unfinished output and scratch directory (from a
    signal handler: never raises)."""
    import shutil

    for proc in list(_CHILDREN):
        try:
            kill_process_group(proc, getattr(proc, "stop_grace", 0.0))
            proc.wait(timeout=5)
        except Exception:
            pass
    staged = list(_COMMAND.staged.values()) if _COMMAND is not None else []
    for path in list(_PENDING) + staged:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        except OSError:
            pass


class _Interrupted(BaseException):
    """A held signal ends the block; _signals_held delivers the signal itself once the file is gone."""


def _write_error_message(path: Path, option: str, err: OSError) -> str:
    code = err.errno
    if code is None:  # h5py puts the system errno into the message text: "..., errno = 28, ..."
        found = re.search(r"errno = (\d+)", str(err))
        code = int(found.group(1)) if found else None
    directory = path.parent if str(path.parent) else Path(".")
    if code in _NO_SPACE:
        return (f"no space left on {directory} while writing {option} {path} ({os.strerror(code)}); nothing was "
                f"written. Free some space (or raise the quota) there, or choose another location.")
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"cannot write {path} ({option}): {first_line}. Nothing was written; check free space and permissions."


def _remove_stale_temporaries(path: Path) -> None:
    """Remove `.NAME.tmp-PID` files beside `path` whose process no longer runs (a run killed by SIGKILL)."""
    pattern = re.compile(re.escape(f".{path.name}.tmp-") + r"(\d+)")
    directory = path.parent if str(path.parent) else Path(".")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _process_alive(int(match.group(1))):
            try:
                (directory / name).unlink()
            except OSError:
                pass  # someone else's file we cannot remove: leave it


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier, failed write
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid at all: leave its file
    return True


@contextmanager
def _unraisable_collected() -> Iterator[list[OSError]]:
    """Collect exceptions raised where Python cannot propagate them (h5py frees objects in __dealloc__, and HDF5
    reports a failed flush there), instead of printing each as an "Exception ignored" traceback."""
    lost: list[OSError] = []
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, OSError):
            lost.append(unraisable.exc_value)
        elif not isinstance(unraisable.exc_value, KeyboardInterrupt):  # a held signal: _signals_held has it
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield lost
    finally:
        sys.unraisablehook = previous


@contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Hold SIGINT and SIGTERM during the block (main thread only); deliver them to the previous handlers after,
    also when the block failed (the interrupt status wins over the error)."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = {signum: signal.getsignal(signum) for signum in _DEFERRED_SIGNALS}
    previous = {signum: handler for signum, handler in previous.items() if handler is not signal.SIG_IGN}

    def hold(signum, frame):
        held.append(signum)
        if len(held) > 1:  # asked twice: stop now (the block removes its temporary file on the way out)
            raise KeyboardInterrupt

    for signum in previous:
        signal.signal(signum, hold)
    try:
        yield held
    except _Interrupted:
        pass  # the file is gone; the signal is delivered below
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(held[0])  # the previous handler acts: KeyboardInterrupt, exit 143, ...
            raise KeyboardInterrupt  # a handler that returned: the write was still abandoned


def agg_figure(figsize: tuple[float, float], option: str = "--plot"):
    """A matplotlib Figure on the Agg canvas (no pyplot, no GUI), or OutputError naming `option`.

    The plots never use a matplotlib backend, so MPLBACKEND (which matplotlib validates when it is first
    imported: a bad value fails the import) is set aside while importing."""
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise OutputError(f"{option} needs matplotlib, which cannot be imported ({err}); install it "
                          f"(pip install matplotlib) or leave out {option}.") from None
    except ValueError as err:  # matplotlib rejects its own configuration (a matplotlibrc value) on import
        raise OutputError(f"{option}: matplotlib's configuration is invalid ({err}); fix it or leave out "
                          f"{option}.") from None
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


FIGURE_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}


def figure_format(path: Path, option: str = "--plot") -> str:
    """The picture format `path`'s extension names (matplotlib's name; no extension: PNG), or OutputError: a
    picture is never written in a format other than the one its name says."""
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "png"
    if suffix not in FIGURE_FORMATS:
        raise OutputError(f"{option} {path}: a {suffix} picture cannot be written; the extension chooses the format: "
                          f"{', '.join(FIGURE_FORMATS)} (PNG, JPEG, SVG, PDF).")
    return FIGURE_FORMATS[suffix]


class SpaceSafeFile:
    """A file for h5py's file-object driver that never reports a failed write to HDF5.

    HDF5 does not survive a failed write: after ENOSPC/EFBIG/EDQUOT it prints errors from every object it frees
    and has been seen to crash (SIGSEGV) in its close. So the first OSError is recorded in `error`, and from then
    on writes go to memory (reads see them), so that HDF5 completes normally; the caller then raises `error` and
    discards the file (`hdf5_target`)."""

    def __init__(self, path: Path):
        self._file = open(path, "w+b", buffering=0)
        self._pos = 0
        self.error: OSError | None = None
        self._pieces: list[tuple[int, bytes]] = []  # writes after the failure, in order

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END:
            pos += self._size()
        elif whence == os.SEEK_CUR:
            pos += self._pos
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def _size(self) -> int:
        on_disk = os.fstat(self._file.fileno()).st_size
        return max([on_disk, *(offset + len(data) for offset, data in self._pieces)])

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self._file.fileno(), view[done:], self._pos + done)
                self._pos += done
                return done
            except OSError as err:
                self.error = err
        self._pieces.append((self._pos, bytes(view)))
        self._pos += len(view)
        return len(view)

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        got = os.preadv(self._file.fileno(), [view], self._pos)
        view[got:] = bytes(len(view) - got)  # past the end of the file reads as zeros (as HDF5 expects)
        end = self._pos + len(view)
        for offset, data in self._pieces:  # later writes win, as on disk
            lo, hi = max(offset, self._pos), min(offset + len(data), end)
            if lo < hi:
                view[lo - self._pos:hi - self._pos] = data[lo - offset:hi - offset]
        self._pos = end
        return len(view)

    def read(self, size: int = -1) -> bytes:
        buffer = bytearray(max(size, 0) if size >= 0 else self._size() - self._pos)
        self.readinto(buffer)
        return bytes(buffer)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        self._pieces = [(offset, data[:max(size - offset, 0)]) for offset, data in self._pieces if offset < size]
        if self.error is None:
            try:
                os.ftruncate(self._file.fileno(), size)
            except OSError as err:
                self.error = err
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as err:
            self.error = self.error or err


@contextmanager
def hdf5_target(tmp: Path) -> Iterator[SpaceSafeFile]:
    """The file object to give h5py.File(..., "w") inside `atomic_output`: after h5py has closed it, a write that
    failed (a full disk) raises its OSError here, which atomic_output reports and cleans up."""
    sink = SpaceSafeFile(tmp)
    try:
        yield sink
    finally:
        sink.close()
    if sink.error is not None:
        raise sink.error
