"""`python:MODULE:FACTORY`: a user's Python implementation, driven step by step like the C ABI.

    FACTORY(config: HeadConfig, weights: dict[str, np.ndarray]) -> impl

`weights` maps the checkpoint's `mtp.*` names to float32 arrays. `impl` must have

    impl.step(pos: int, embed_row: ndarray[D], hidden: ndarray[D], out: ndarray[D], trace: dict[str, ndarray])

which writes the step's output into `out` and each captured stage into `trace[name]` (row views of poisoned
buffers: write with `trace["fc"][:] = ...`, not by rebinding). `impl.capture` (optional) lists the stages it
captures, in any order; the others are "not captured". The impl keeps its own KV cache across its step() calls;
FACTORY is called once per run, so every run starts with an empty cache.
"""

import dataclasses
import importlib
import traceback
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint
from oracle.progress import Progress
from oracle.stages import INDEX_SET
from oracle.trace import TraceInputs
from probe.errors import AdapterError, CandidateError
from probe.poison import poison


# What a Python candidate's own code may raise that the probe reports as INVALID: any error, and sys.exit() (a
# candidate that exits would otherwise end the probe with its exit code and no verdict). Ctrl-C still interrupts.
# os._exit() cannot be caught: a Python candidate shares the probe's process (a C library runs in a child).
CANDIDATE_FAULTS = (Exception, SystemExit)


class PythonAdapter:
    deterministic = True
    capture_only: tuple[str, ...] | None = None  # set by --explain's observer check: capture at most these

    def __init__(self, spec: str, checkpoint: Path, conventions: dict | None = None):
        module_name, _, factory_name = spec.partition(":")
        if not module_name or not factory_name:
            raise AdapterError(f"--impl python:{spec}: expected python:MODULE:FACTORY, e.g. python:my_engine:make_head.")
        try:
            factory = getattr(importlib.import_module(module_name), factory_name)
        except SystemExit as err:  # the module's own code ran sys.exit() on import
            raise CandidateError(f"--impl python:{spec}: importing {module_name} called sys.exit({err.code!r}); a "
                                 f"candidate module must not exit the probe's process.") from None
        except (ImportError, AttributeError) as err:
            raise AdapterError(f"--impl python:{spec}: cannot load {factory_name} from {module_name} ({err}). "
                               f"Is the module on PYTHONPATH?") from None
        ckpt = Checkpoint(checkpoint)
        self.name = f"python:{spec}"
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

    def run(self, inputs: TraceInputs) -> dict[str, np.ndarray]:
        try:
            impl = self._make()  # a fresh impl per run: its KV cache must start empty
        except CANDIDATE_FAULTS as err:  # the candidate's own code: report it, never crash the probe
            raise self._raised(err, f"in {self._factory_name}()") from None
        if not callable(getattr(impl, "step", None)):
            raise AdapterError(f"{self.name}: the object {self._factory_name}() returned has no step() method.")
        traceable = tuple(n for n in self._stages.names if n != "out")
        capture = _captured_stages(impl, self.name, traceable)
        if self.capture_only is not None:
            capture = tuple(n for n in capture if n in self.capture_only)
        t, d = inputs.num_tokens, inputs.hidden_size
        buffers = {n: _unwritten(self._stages[n], (t, self._stages[n].width(self._dims))) for n in capture}
        buffers["out"] = poison((t, d))
        with Progress(f"candidate {self.name}", t) as bar:
            for i in range(t):
                rows = {n: buffers[n][i] for n in capture}  # views: the impl writes into the buffers
                try:
                    impl.step(int(inputs.positions[i]), inputs.embed[i].copy(), inputs.hidden[i].copy(),
                              buffers["out"][i], rows)
                except CANDIDATE_FAULTS as err:  # the candidate's own code: report it, never crash the probe
                    raise self._raised(err, f"at step {i}") from None
                bar.update()
        return buffers

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
    declared = tuple(getattr(impl, "capture", traceable))  # any iterable, read once (a generator too)
    unknown = sorted(set(declared) - set(traceable))
    if unknown:
        raise AdapterError(f"{name}: capture lists unknown stages {unknown}; valid: {', '.join(traceable)}.")
    return tuple(n for n in traceable if n in declared)


def _unwritten(stage, shape) -> np.ndarray:
    """A buffer that shows which rows were never written: poison for float rows, -1 for index sets (ids >= 0)."""
    return np.full(shape, -1, dtype=np.int64) if stage.kind == INDEX_SET else poison(shape)
