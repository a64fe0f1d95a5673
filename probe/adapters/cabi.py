"""The C ABI adapter: a shared library implementing fixtures/candidates/mtp_probe.h (ABI v1, the dense Qwen3.5
head) or mtp_probe_v2.h (ABI v2, any family: weights and stages as named tables), run in a child process.

`CAbiAdapter(library, checkpoint).run(inputs)` hands the library the checkpoint's head weights and the reference's
inputs, and returns the rows it wrote. The library runs inside `python -m probe.adapters.cabi_worker`, so a
segfault or abort in foreign code becomes an AdapterError naming the signal and the step, never a dead probe; the
worker also tells which ABI the library speaks, by its symbols (a v2 library exports `mtp2_abi_version`): the
library is never loaded into the probe's own process.
`build_library` compiles a .c (gcc) or .cu (nvcc) candidate into such a library.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.output import kill_process_group, removed_on_interrupt, run_ended_with_us, scratch_directory
from oracle.progress import Progress
from oracle.text import printable
from oracle.trace import TraceInputs, inputs_digest
from probe.adapters import cabi_worker as worker
from probe.adapters.cabi_process import (STDERR_FILE, STDOUT_FILE, EarlyWorker, start_worker, stop_worker,
                                         worker_command, worker_output)
from probe.errors import AdapterError, CandidateError, ProbeError

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding probe/ (and, in a checkout, fixtures/)
HEADER_DIR = _PACKAGE_ROOT / "fixtures" / "candidates"  # mtp_probe.h, mtp_probe_v2.h
_TOOLCHAINS = {  # suffix -> (compiler, flags before the sources, flags after)
    ".c": ("gcc", ["-O2", "-std=c11", "-shared", "-fPIC"], ["-lm"]),
    ".cu": ("nvcc", ["-O2", "-shared", "-Xcompiler", "-fPIC"], []),
}
_TAIL_CHARS = 2000
_INT32_MAX = 2**31 - 1


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _TAIL_CHARS else "…" + text[-_TAIL_CHARS:]


def library_name(source: Path, defines: tuple[str, ...]) -> str:
    """`mtp_step.so` (`mtp_step_cuda.so` from a .cu), `mtp_step-MTP_MUTANT_W_NORM.so` with defines: every source
    kind and define set gets its own file, so builds never overwrite each other."""
    stem = source.stem + ("_cuda" if source.suffix == ".cu" else "")
    tags = ["".join(ch if ch.isalnum() or ch in "_." else "_" for ch in d) for d in defines]
    return "-".join([stem, *tags]) + ".so"


def build_library(source: Path, out_dir: Path, defines: tuple[str, ...] = ()) -> Path:
    """Compile `source` (.c with gcc, .cu with nvcc) into a shared library in `out_dir`; `defines` are macro
    names (or NAME=VALUE) passed as -D. The header directory and the source's own are on the include path."""
    source, out_dir = Path(source), Path(out_dir)
    if source.suffix not in _TOOLCHAINS:
        raise AdapterError(f"cannot build {source}: build_library compiles .c (gcc) and .cu (nvcc) files. "
                           f"Build other sources into a .so yourself and pass the library.")
    if not source.is_file():
        raise AdapterError(f"candidate source {source} does not exist; check the path.")
    compiler, flags, libs = _TOOLCHAINS[source.suffix]
    if shutil.which(compiler) is None:
        raise AdapterError(f"{compiler} is not on PATH, so {source.name} cannot be built here. Install it, or "
                           f"build the library elsewhere and pass the .so.")
    out = out_dir / library_name(source, defines)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # a half-written .so must never carry the final name
    cmd = [compiler, *flags, f"-I{HEADER_DIR}", f"-I{source.parent}", *(f"-D{d}" for d in defines), str(source),
           "-o", str(tmp), *libs]
    with removed_on_interrupt(tmp):
        proc = _compile(cmd)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        shown = [str(out) if arg == str(tmp) else arg for arg in cmd]
        raise AdapterError(f"building {source.name} failed (exit status {proc.returncode}). Command:\n"
                           f"  {shlex.join(shown)}\n{_tail(proc.stderr + proc.stdout)}")
    os.replace(tmp, out)
    return out


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in its own process group, ended with it on an interrupt (SIGTERM first; cc1, as and ld with
    it: killing the driver alone left ld to write the .so), with a TMPDIR of its own that an interrupt removes after
    it (gcc's ccXXXX.s files had stayed in the user's TMPDIR)."""
    with scratch_directory("mtp-cc-") as scratch:
        return run_ended_with_us(cmd, 2.0, env={**os.environ, "TMPDIR": scratch})


class CAbiAdapter:
    """Runs a library implementing mtp_probe.h or mtp_probe_v2.h step by step over the inputs, in a child process.
    `conventions` (the reference's engine conventions, e.g. norm_topk_prob) go into a v2 library's config.
    `early`: a worker already started on the reference (probe/adapters/cabi_process.py early_worker); the first
    run() waits for it instead of starting one, and checks it ran on the very inputs and conventions given."""

    deterministic = True
    supports_chains = True  # a v2 library exporting mtp2_draft_step is driven through the reference's chains
    weights_digest: str | None = None  # known once run() has loaded the weights
    capture_only: tuple[str, ...] | None = None  # set by --explain's observer check: capture at most these
    output: str = ""  # what the candidate printed in its last run (stdout, then stderr): cut, escaped (`_printed`)
    _EXIT_HINT = "did the library call exit()?"

    def __init__(self, library: Path, checkpoint: Path, conventions: dict | None = None,
                 early: EarlyWorker | None = None):
        self.library = Path(library).resolve()
        if not self.library.is_file():
            what = ("does not exist" if not self.library.exists() else
                    "is a directory" if self.library.is_dir() else "is not a regular file (a device, FIFO or socket)")
            raise AdapterError(f"C library {library} {what}. Pass the path of a built .so (--impl c:PATH, "
                               f"CAbiAdapter(library=...)); build one with probe.adapters.cabi.build_library "
                               f"or gcc -shared -fPIC.")
        self.checkpoint = Path(checkpoint)
        ckpt = Checkpoint(self.checkpoint)  # fails early on a bad checkpoint (a v1 library and a head of
        # another family are refused by the worker, which is where the library's ABI is known)
        self.hidden_size = ckpt.config.hidden_size  # D: one embedding row
        self.hidden_width = ckpt.family.dims(ckpt.config).hc_mult * ckpt.config.hidden_size  # one `hidden` row
        self.conventions = dict(conventions or {})
        self.name = f"c:{self.library.name}"
        self._early = early if early is not None and early.serves(self.library, self.checkpoint) else None

    def run(self, inputs: TraceInputs, chain: dict[int, dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
        """Stage -> [T, width] for the stages the library captures, plus `out`: float32 (int64 for index sets
        such as topk_ids); rows it never wrote keep the poison pattern (-1). Stages its mtp_capture_mask /
        mtp2_capture excludes are absent, never filled in. With `chain` (the reference's chain inputs) a v2
        library exporting mtp2_draft_step also gives "d{j}": depth j's buffers (an early worker read them from
        the reference itself)."""
        self._check_inputs(inputs)
        early, self._early = self._early, None  # the first run only: --explain's reruns capture other stages
        if early is not None and self.capture_only is None:
            expected = inputs_digest(inputs)  # while the worker runs
            return self._results(early.proc, early.work, inputs.num_tokens, (expected, self.conventions))
        with scratch_directory("mtp-cabi-") as tmp:
            work = Path(tmp)
            np.save(work / "embed.npy", np.ascontiguousarray(inputs.embed, dtype=np.float32))
            np.save(work / "hidden.npy", np.ascontiguousarray(inputs.hidden, dtype=np.float32))
            np.save(work / "positions.npy", np.asarray(inputs.positions, dtype=np.int64))
            if self.capture_only is not None:
                (work / worker.CAPTURE_ONLY_FILE).write_text(",".join(self.capture_only))
            (work / worker.CONVENTIONS_FILE).write_text(json.dumps(self.conventions))
            if chain:
                np.savez(work / worker.CHAIN_FILE, **{f"d{j}_{n}": v for j, part in chain.items()
                                                      for n, v in part.items()})
            self._prepare(work)
            proc = start_worker(worker_command(self._worker_target(), self.checkpoint, work), work)
            return self._results(proc, work, inputs.num_tokens)

    def _results(self, proc: subprocess.Popen, work: Path, num_steps: int,
                 from_reference: tuple[str, dict] | None = None) -> dict[str, np.ndarray]:
        """Wait for the worker and read what it wrote; `from_reference`: (inputs digest, conventions) it must have
        read from the reference itself."""
        finished = _wait_worker(proc, work, self.name, num_steps)
        self.output = _printed(finished)
        if finished.returncode != 0:
            raise self._failure(finished, work)
        if not (work / worker.MANIFEST_FILE).is_file():  # e.g. the library called exit(0) inside a step
            raise CandidateError(f"{self.name}: the process running it exited with status 0 "
                                 f"{_phase_description(work)} without finishing the run "
                                 f"({self._EXIT_HINT}). Its stderr:\n{_tail(finished.stderr) or '(none)'}")
        manifest = json.loads((work / worker.MANIFEST_FILE).read_text())
        if from_reference is not None:
            _check_same_inputs(manifest, *from_reference)
        self.weights_digest = manifest["weights_digest"]  # of the weights the library was actually given
        depths = {key: {name: np.load(work / f"{key}.{name}.npy") for name in names}
                  for key, names in manifest.get("depths", {}).items()}
        return {name: np.load(work / f"{name}.npy") for name in manifest["captured"]} | depths

    def _worker_target(self) -> str:
        """What the worker runs (its first argument): the library's path."""
        return str(self.library)

    def _prepare(self, work: Path) -> None:
        """Anything more the worker reads from `work` before it starts (nothing, for a library)."""

    def _diagnosed(self, message: str, kind: str) -> AdapterError:
        """The failure the worker diagnosed itself (error.txt; `kind`: its class name)."""
        return AdapterError(f"{self.name}: {message}")

    def _check_inputs(self, inputs: TraceInputs) -> None:
        # inputs.hidden_size is D, the embedding rows' width; a hidden row is hidden_width = hc·D wide (DeepSeek-V4's
        # hc residual streams), so each is checked against its own width (comparing D with hc·D refused every V4 run)
        for what, width, want in (("hidden", np.shape(inputs.hidden)[-1], self.hidden_width),
                                  ("embedding", np.shape(inputs.embed)[-1], self.hidden_size)):
            if width != want:
                raise AdapterError(f"the inputs have {what} rows of {width} but checkpoint {self.checkpoint}'s head "
                                   f"takes {want}; pass the checkpoint the reference was exported from.")
        positions = np.asarray(inputs.positions)
        if positions.size and (positions.min() < 0 or positions.max() > _INT32_MAX):
            raise AdapterError(f"positions must fit 0..{_INT32_MAX} (C ABI v1's `int pos`; the oracle never exports "
                               f"past 2**24); the inputs hold {positions.min()}..{positions.max()}.")

    def _failure(self, proc: subprocess.CompletedProcess, work: Path) -> AdapterError:
        """Turn a failed worker into a message: its own diagnosis, the signal that killed it, or its stderr."""
        stderr = _tail(proc.stderr) or "(no stderr)"
        if proc.returncode == worker.EXIT_DIAGNOSED and (work / worker.ERROR_FILE).is_file():
            said = f" Its stderr:\n{stderr}" if proc.stderr.strip() else ""  # e.g. which CUDA call failed
            kind = worker_output(work, worker.ERROR_KIND_FILE).strip()
            return self._diagnosed(f"{(work / worker.ERROR_FILE).read_text()}{said}", kind)
        where = _phase_description(work)
        if proc.returncode < 0:
            sig = _signal_name(-proc.returncode)
            return CandidateError(f"{self.name} crashed with {sig} {where}. The library ran in a child process, "
                                f"so only it died; debug that call (gdb, valgrind, compute-sanitizer). "
                                f"Its stderr:\n{stderr}")
        return AdapterError(f"the worker running {self.name} exited with status {proc.returncode} {where}. "
                            f"Its stderr:\n{stderr}")


_OUTPUT_CHARS = 4000  # of what a candidate printed, shown in the report (its last characters)


def _printed(proc: subprocess.CompletedProcess) -> str:
    """What the candidate printed, stdout then stderr, cut to its last _OUTPUT_CHARS characters each, with control
    and bidi characters escaped (oracle/text.py): the report shows it before the verdict line, never after."""
    parts = []
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        text = text.rstrip()
        if text:
            cut = f", its last {_OUTPUT_CHARS} characters" if len(text) > _OUTPUT_CHARS else ""
            parts.append(f"[{stream}{cut}]\n{printable(text[-_OUTPUT_CHARS:], keep_lines=True)}")
    return "\n".join(parts)


def _check_same_inputs(manifest: dict, expected_digest: str, conventions: dict) -> None:
    """A worker started early read the reference itself: it must have read what the probe read."""
    if manifest.get("inputs_digest") != expected_digest or manifest.get("conventions") != conventions:
        raise ProbeError(f"the reference changed while the candidate ran: the worker read inputs "
                         f"{manifest.get('inputs_digest')} with conventions {manifest.get('conventions')}, the probe "
                         f"{expected_digest} with {conventions}. Run again once the reference is no longer written.")


def _wait_worker(proc: subprocess.Popen, work: Path, name: str, num_steps: int) -> subprocess.CompletedProcess:
    """Wait for the worker to end; while progress is shown, its steps are read from the phases it appends to
    progress.txt (the file a crash is located by) four times a second."""
    with Progress(f"candidate {name}", num_steps) as bar:
        try:
            while True:
                try:
                    proc.wait(timeout=0.25 if bar.shown else None)
                    break
                except subprocess.TimeoutExpired:
                    bar.update(max(0, _steps_done(work / worker.PROGRESS_FILE, num_steps) - bar.done))
        except BaseException:
            stop_worker(proc)
            raise
        finally:
            kill_process_group(proc)  # it has ended: what it forked must not outlive the run
        if proc.returncode == 0:
            bar.update(num_steps - bar.done)
    return subprocess.CompletedProcess(proc.args, proc.returncode, worker_output(work, STDOUT_FILE),
                                       worker_output(work, STDERR_FILE))


def _steps_done(progress: Path, num_steps: int) -> int:
    """Steps the worker has finished: the last `step t` line means t are done; after the loop, all of them."""
    try:
        phases = progress.read_text().splitlines() if progress.is_file() else []
        phase = phases[-1].split("\t")[0] if phases else ""
        if phase.startswith("step "):
            return int(phase.split()[1])
    except (OSError, ValueError, IndexError):  # a line being written
        return 0
    return num_steps if phase in ("destroy", "save") else 0


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({signal.strsignal(number)})"
    except ValueError:
        return f"signal {number}"


def _phase_description(work: Path) -> str:
    """Where the worker was, from the last phase it announced before dying (functions named for the ABI the worker
    detected: mtp_step, or mtp2_step for a v2 library)."""
    progress, abi_file = work / worker.PROGRESS_FILE, work / worker.ABI_FILE
    phases = progress.read_text().splitlines() if progress.is_file() else []
    phase = phases[-1].split("\t")[0] if phases else ""
    abi = abi_file.read_text().strip() if abi_file.is_file() else ""
    if abi == "python":
        return _python_phase(phase)
    fn = "mtp2_" if abi == "2" else "mtp_"
    if phase.startswith("step "):
        return f"in {phase} (the {fn}step call for token row {phase.split()[1]})"
    return {"load": f"while loading the library or the checkpoint (before {fn}create)",
            "create": f"in {fn}create", "destroy": f"in {fn}destroy",
            "save": f"after {fn}destroy, while saving the results"}.get(phase, "before it started (no progress)")


def _python_phase(phase: str) -> str:
    """Where a Python candidate's worker was (probe/adapters/python.py StepDriver's phases)."""
    if phase.startswith("step "):
        return f"in {phase} (its step() call for token row {phase.split()[1]})"
    return {"load": "while importing the candidate or reading the checkpoint",
            "create": "in its factory (or reading its step and capture)", "destroy": "after its last step",
            "save": "after its last step, while saving the results"}.get(phase, "before it started (no progress)")
