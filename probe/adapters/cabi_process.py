"""Starting the C-ABI worker process (probe/adapters/cabi_worker.py), with the standard library only, so that
`mtp-probe run --impl c:LIB --checkpoint DIR` can start it before the probe itself imports numpy and h5py.

Started early (`early_worker`), the worker reads the reference's inputs and conventions itself. While it starts up,
maps the checkpoint and steps the library, the probe imports what it needs and reads and checks the reference and
its options; `CAbiAdapter.run` then waits for it and checks that it ran on exactly the inputs the probe read (their
digest) with the same conventions. An error before that kills the worker, so the user sees what a start after the
checks would have shown (the library has merely been loaded and run; it writes nothing the probe keeps).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from oracle.output import kill_process_group, killed_on_interrupt, removed_on_interrupt

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding probe/ (and, in a checkout, fixtures/)
STDOUT_FILE, STDERR_FILE = "stdout.txt", "stderr.txt"  # the worker's own output, read once it has ended


def worker_command(library: Path, checkpoint: Path, work: Path, reference: Path | None = None) -> list[str]:
    """`python -m probe.adapters.cabi_worker LIB CHECKPOINT DIR [REFERENCE]`: with REFERENCE, the worker reads its
    inputs from it; without, from DIR (embed.npy, hidden.npy, positions.npy, conventions.json)."""
    return [sys.executable, "-m", "probe.adapters.cabi_worker", str(library), str(checkpoint), str(work),
            *([str(reference)] if reference is not None else [])]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment (plus `extra`), with this package importable by `python -m` whatever the working
    directory."""
    env = dict(os.environ) | (extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    env["MTP_PROBE_WORKER_PARENT"] = str(os.getpid())  # cabi_worker.py die_with_the_probe
    return env


def start_worker(command: list[str], work: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the worker with its stdout and stderr in files in `work`: a pipe that nobody reads yet (the probe is
    busy with its own checks) would stall a chatty library once it filled up, and nothing the candidate prints
    reaches the probe's own stdout (where the verdict line is the last). The worker leads its own process group, so
    that ending it (`stop_worker`, or an interrupt) also ends whatever the candidate forked."""
    with open(work / STDOUT_FILE, "wb") as out, open(work / STDERR_FILE, "wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=worker_env(extra_env), start_new_session=True)
    proc.leads_its_group = True  # oracle/output.py kill_process_group
    return killed_on_interrupt(proc)


def stop_worker(proc: subprocess.Popen) -> None:
    """Kill the worker, if it still runs, and every process it left in its group; reap it."""
    kill_process_group(proc)
    proc.wait()


_OUTPUT_READ = 1 << 20  # of a worker's stdout or stderr, the last bytes read (reports show far less of them)


def worker_output(work: Path, name: str) -> str:
    """The end of a file the worker wrote (at most _OUTPUT_READ bytes: a candidate may print without end), as
    written: a "\r" stays one, for the report to escape."""
    try:
        with open(work / name, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _OUTPUT_READ))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class EarlyWorker:
    """A worker started before the probe's checks, on the reference's own inputs, in its own scratch folder."""

    library: Path  # resolved
    checkpoint: Path
    reference: Path
    work: Path
    proc: subprocess.Popen

    def serves(self, library: Path, checkpoint: Path) -> bool:
        return self.library == Path(library).resolve() and Path(self.checkpoint) == Path(checkpoint)

    def stop(self) -> None:
        stop_worker(self.proc)


def plain_safetensors(checkpoint: Path) -> bool:
    """A checkpoint folder in the HF safetensors layout (oracle/checkpoint.py's SINGLE_NAME / INDEX_NAME). A GGUF
    one is dequantized into a cache folder on first use (oracle/gguf_source.py), which the probe's own checks and an
    early worker would then both write: its worker starts after the checks, as before."""
    checkpoint = Path(checkpoint)
    return (checkpoint / "config.json").is_file() and any(
        (checkpoint / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


@contextmanager
def early_worker(library: Path | None, checkpoint: Path | None, reference: Path) -> Iterator[EarlyWorker | None]:
    """Within the block, the worker for `library` on `checkpoint` runs on `reference`'s inputs (None when there is
    no library file or no plain safetensors checkpoint to start it with: the adapter then starts its worker after
    the checks, and says what is wrong with them). On leaving, a worker still running is killed and its folder
    removed."""
    if library is None or checkpoint is None or not Path(library).is_file() or not plain_safetensors(checkpoint):
        yield None
        return
    work = Path(tempfile.mkdtemp(prefix="mtp-cabi-"))
    early = None
    with removed_on_interrupt(work):
        try:
            library = Path(library).resolve()
            early = EarlyWorker(library, Path(checkpoint), Path(reference), work,
                                start_worker(worker_command(library, checkpoint, work, reference), work))
            yield early
        finally:
            if early is not None:
                early.stop()
            shutil.rmtree(work, ignore_errors=True)
