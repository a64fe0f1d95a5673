"""`python:MODULE:FACTORY`: a user's Python implementation, driven step by step like the C ABI.

    FACTORY(config: HeadConfig, weights: dict[str, np.ndarray]) -> impl

`weights` maps the checkpoint's `mtp.*` names to float32 arrays. `impl` must have

    impl.step(pos: int, embed_row: ndarray[D], hidden: ndarray[D], out: ndarray[D], trace: dict[str, ndarray])

which writes the step's output into `out` and each captured stage into `trace[name]` (row views of poisoned
buffers: write with `trace["fc"][:] = ...`, not by rebinding). `impl.capture` (optional) lists the stages it
captures, in any order; the others are "not captured". The impl keeps its own KV cache across its step() calls;
FACTORY is called once per run, so every run starts with an empty cache.

The candidate runs in a child process, the C ABI's worker (`python -m probe.adapters.cabi_worker
python:MODULE:FACTORY CHECKPOINT DIR`, probe/adapters/cabi_process.py), with the probe's import path: what its code
does outside its steps (an atexit handler, a non-daemon thread or a __del__ that prints after the verdict line,
os._exit, a chdir, a hang) cannot forge the probe's verdict, end or stall the probe, or move its outputs. What it
prints is captured and shown, cut and escaped, before the verdict (`CAbiAdapter.output`). `PythonAdapter` is the
probe's side; `StepDriver`, the worker's, calls the candidate.
The draft loop (optional, issue 24): against a reference with chains, an impl that has

    impl.draft_step(depth: int, token: int, pos: int, embed_row: ndarray[D], out: ndarray[D], trace: dict)

is driven in the engine's own order: step() for bridge i, then draft_step(j, token, pos, ...) for its chain j = 2,
3, ... (while bridge i has depth j), then step() for bridge i+1. No hidden is handed in: the engine recycles its
own (and chooses which layer runs); `out` and `trace` are rows of depth j's buffers (row i = bridge i). Dropping
the chain's KV rows before the next bridge step is the engine's job too, so a chain row left in its cache shows as
a divergence at the next bridge step. An impl without draft_step captures no chain (the verdict says so).
"""

import dataclasses
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.stages import INDEX_SET
from probe.adapters.cabi import CAbiAdapter
from probe.errors import AdapterError, CandidateError
from probe.poison import poison

SYS_PATH_FILE = "sys_path.json"  # the probe's sys.path, in the worker's DIR: the candidate imports as it would here


# What a Python candidate's own code may raise that the probe reports as INVALID: anything but Ctrl-C, which still
# interrupts. That includes sys.exit() (a candidate that exits would otherwise end the run with its exit code and
# no verdict) and the other BaseExceptions, e.g. asyncio.CancelledError or GeneratorExit leaking from an async engine
# (they had ended the probe with exit 1, "diverged", and nothing compared). os._exit() cannot be caught: it ends
# the worker without its results, which the probe reports (INVALID).
CANDIDATE_FAULTS = (BaseException,)
NOT_CANDIDATE_FAULTS = (KeyboardInterrupt,)


def _import_failure(spec: str, module_name: str, err: ImportError) -> str:
    """Why MODULE did not import: not found (PYTHONPATH), or found but an import inside it failed (its own imports
    are the problem, not the path)."""
    origin = _module_file(module_name)
    if origin is None:
        return (f"--impl python:{spec}: cannot import {module_name} ({err}). Is the module on PYTHONPATH (e.g. "
                f"PYTHONPATH=path/to/dir mtp-probe run …)?")
    return (f"--impl python:{spec}: {module_name} was found ({origin}), but importing it failed inside it: "
            f"{type(err).__name__}: {err}. Fix that import (a missing package or name) in the module.")


def _module_file(module_name: str) -> str | None:
    """Where `module_name` would be imported from, or None when Python cannot find it."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package missing, or a bad name
        return None
    return None if found is None else (found.origin or module_name)


class PythonAdapter(CAbiAdapter):
    """The probe's side: runs `StepDriver` in the worker process over the inputs and reads back its rows, as
    CAbiAdapter does for a library (the same files, waiting, crash and exit reports)."""

    def __init__(self, spec: str, checkpoint: Path, conventions: dict | None = None):
        module_name, _, factory_name = spec.partition(":")
        if not module_name or not factory_name:
            raise AdapterError(f"--impl python:{spec}: expected python:MODULE:FACTORY, e.g. python:my_engine:make_head.")
        self.spec, self.name = spec, f"python:{spec}"
        self.checkpoint = Path(checkpoint).absolute()
        Checkpoint(self.checkpoint)  # a bad checkpoint fails here, before the worker starts
        self.conventions = dict(conventions or {})
        self._early = None

    def _check_inputs(self, inputs) -> None:
        pass  # a Python step takes any position and the rows as they are; the worker checks what it reads

    def _worker_target(self) -> str:
        return f"python:{self.spec}"

    def _prepare(self, work: Path) -> None:
        (work / SYS_PATH_FILE).write_text(json.dumps([str(Path(p).absolute()) for p in sys.path]))

    def _diagnosed(self, message: str, kind: str) -> AdapterError:
        return (CandidateError if kind == CandidateError.__name__ else AdapterError)(message)

    _EXIT_HINT = "did the candidate call os._exit()?"


class StepDriver:
    """The worker's side: imports the candidate, calls FACTORY once per `run` and steps it over the inputs, in the
    worker process (never the probe's)."""

    capture_only: tuple[str, ...] | None = None  # --explain's observer check: capture at most these

    def __init__(self, spec: str, checkpoint: Path, conventions: dict | None = None):
        module_name, _, factory_name = spec.partition(":")
        self.name = f"python:{spec}"
        try:
            module = importlib.import_module(module_name)
        except NOT_CANDIDATE_FAULTS:
            raise
        except SystemExit as err:  # the module's own code ran sys.exit() on import
            raise CandidateError(f"--impl python:{spec}: importing {module_name} called sys.exit({err.code!r}); a "
                                 f"candidate module must not exit the probe's process.") from None
        except ImportError as err:
            raise AdapterError(_import_failure(spec, module_name, err)) from None
        except CANDIDATE_FAULTS as err:  # the module's own code failed on import
            raise CandidateError(f"--impl python:{spec}: importing {module_name} raised {type(err).__name__}: "
                                 f"{err}") from None
        factory = getattr(module, factory_name, None)
        if factory is None:
            raise AdapterError(f"--impl python:{spec}: {module_name} ({getattr(module, '__file__', module_name)}) has "
                               f"no {factory_name}; give the name of its factory function.")
        ckpt = Checkpoint(checkpoint)
        head = ckpt.read_head()
        self.weights_digest = head.digest
        # The reference's conventions (e.g. norm_topk_prob), not config.json's, where the reference records them.
        fields = {f.name for f in dataclasses.fields(ckpt.config)}
        config = dataclasses.replace(ckpt.config, **{k: v for k, v in (conventions or {}).items() if k in fields})
        self._make = lambda: factory(config, head.tensors)
        self._factory_name = factory_name
        # Every stage of the checkpoint's family but `out` (which the step writes into `out`).
        self._stages = ckpt.family.stages(ckpt.config)
        self._dims = ckpt.family.dims(ckpt.config)

    def run(self, embed: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
            progress: Callable[[str], None],
            chain: dict[int, dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
        """Stage -> [T, width] rows the candidate wrote (poison where it did not), plus `out`; `progress(phase)` is
        told each step before it starts (cabi_worker.Progress: a crash is located by it). With `chain` ({j:
        token_ids, positions, embed of depth j}, the worker's chain.npz) and an impl with draft_step, also "d{j}":
        depth j's buffers."""
        progress("create")
        impl = self._candidate(self._make, f"in {self._factory_name}()")  # fresh per run: an empty KV cache
        step = self._candidate(lambda: getattr(impl, "step", None), "reading its step attribute")
        if not callable(step):
            raise AdapterError(f"{self.name}: the object {self._factory_name}() returned has no step() method.")
        traceable = tuple(n for n in self._stages.names if n != "out")
        capture = self._candidate(lambda: _captured_stages(impl, self.name, traceable), "reading its capture list")
        if self.capture_only is not None:
            capture = tuple(n for n in capture if n in self.capture_only)
        t = len(positions)
        buffers = self._buffers(capture, t)
        draft = self._candidate(lambda: getattr(impl, "draft_step", None), "reading its draft_step attribute") \
            if chain else None
        depths = {j: self._buffers(capture, len(part["token_ids"])) for j, part in chain.items()} \
            if callable(draft) else {}
        for i in range(t):
            progress(f"step {i}")
            rows = {n: buffers[n][i] for n in capture}  # views: the impl writes into the buffers
            self._candidate(lambda: step(int(positions[i]), embed[i].copy(), hidden[i].copy(), buffers["out"][i],
                                         rows), f"at step {i}")
            for j in (j for j in sorted(depths) if i < len(chain[j]["token_ids"])):  # bridge i's chain
                progress(f"draft {j} of step {i}")
                self._draft(draft, j, i, chain[j], depths[j], capture)
        progress("destroy")
        return buffers | {f"d{j}": part for j, part in depths.items()}

    def _buffers(self, capture: tuple[str, ...], rows: int) -> dict[str, np.ndarray]:
        out = {n: _unwritten(self._stages[n], (rows, self._stages[n].width(self._dims))) for n in capture}
        return out | {"out": poison((rows, self._dims.hidden_size))}

    def _draft(self, draft, depth: int, i: int, part: dict, buffers: dict, capture: tuple[str, ...]) -> None:
        """Depth `depth` of bridge i's chain: the reference's token, position and embedding row, no hidden."""
        rows = {n: buffers[n][i] for n in capture}
        self._candidate(lambda: draft(depth, int(part["token_ids"][i]), int(part["positions"][i]),
                                      part["embed"][i].copy(), buffers["out"][i], rows),
                        f"at depth {depth} of bridge {i}")

    def _candidate(self, call, where: str):
        """call() runs the candidate's own code: what it raises is reported (INVALID, exit 2), never a probe crash
        (exit 4) or an exit code of its own; Ctrl-C still interrupts."""
        try:
            return call()
        except NOT_CANDIDATE_FAULTS:
            raise
        except AdapterError:  # the probe's own finding about the candidate (e.g. an unknown stage in capture)
            raise
        except CANDIDATE_FAULTS as err:
            raise self._raised(err, where) from None

    def _raised(self, err: BaseException, where: str) -> CandidateError:
        """`candidate raised ValueError at step 3: msg`, with the candidate's own frames (not the probe's)."""
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not _is_probe_frame(f.filename)]
        shown = "".join(traceback.format_list(frames[-6:])).rstrip()
        what = (f"called sys.exit({err.code!r}) {where} (a candidate must not end the probe's process)"
                if isinstance(err, SystemExit) else f"raised {type(err).__name__} {where}: {err}")
        return CandidateError(f"candidate {what}"
                              + (f"\ncandidate traceback (most recent call last):\n{shown}" if shown else ""))


def _is_probe_frame(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(Path(__file__).resolve().parents[1])


def _captured_stages(impl, name: str, traceable: tuple[str, ...]) -> tuple[str, ...]:
    declared = getattr(impl, "capture", traceable)
    if isinstance(declared, (str, bytes)) or not isinstance(declared, Iterable):
        raise AdapterError(f"{name}: capture must list stage names (e.g. a tuple of str), found "
                           f"{type(declared).__name__} {declared!r:.60}; valid names: {', '.join(traceable)}.")
    declared = tuple(declared)  # any iterable, read once (a generator too)
    if not all(isinstance(n, str) for n in declared):
        raise AdapterError(f"{name}: capture must list stage names as str; found {declared!r:.80}.")
    unknown = sorted(set(declared) - set(traceable))
    if unknown:
        raise AdapterError(f"{name}: capture lists unknown stages {unknown}; valid: {', '.join(traceable)}.")
    return tuple(n for n in traceable if n in declared)


def _unwritten(stage, shape) -> np.ndarray:
    """A buffer that shows which rows were never written: poison for float rows, -1 for index sets (ids >= 0)."""
    return np.full(shape, -1, dtype=np.int64) if stage.kind == INDEX_SET else poison(shape)
