"""Building candidate traces for the diff tests: copies of the stored reference, modified, written as HDF5 or raw."""

import json
from pathlib import Path

import numpy as np
import pytest

from oracle.stages import STAGE_BY_NAME, STAGE_NAMES
from oracle.trace import TraceInputs, read_trace, write_trace
from probe.cli import cli
from tests.helpers import TINY, TINY_REF, run_cli

VERDICT_WORDS = ("PASSED |", "DIVERGED |", "INVALID |", "INCONCLUSIVE |")


def load_trace(path: Path) -> tuple[TraceInputs, dict[str, np.ndarray]]:
    with read_trace(path) as reader:
        return reader.inputs(), {name: reader.stage_rows(name) for name in reader.stages}


@pytest.fixture(scope="session")
def ref_data() -> tuple[TraceInputs, dict[str, np.ndarray]]:
    """Inputs and stages of the stored reference (T=8, D=64); copy before modifying."""
    return load_trace(TINY_REF)


@pytest.fixture(scope="session")
def ref_t1(tmp_path_factory) -> Path:
    """A T=1 reference written by the oracle."""
    from oracle.cli import main

    path = tmp_path_factory.mktemp("t1") / "ref_t1.h5"
    main(["export", str(TINY), "--out", str(path), "--tokens", "17", "--hidden-seed", "0", "-q"],
         standalone_mode=False)
    return path


def synthetic(tokens: int, hidden: int) -> tuple[TraceInputs, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    inputs = TraceInputs(np.arange(tokens, dtype=np.int64), np.arange(tokens, dtype=np.int64),
                         rng.standard_normal((tokens, hidden), dtype=np.float32),
                         rng.standard_normal((tokens, hidden), dtype=np.float32))
    stages = {s.name: rng.standard_normal((tokens, s.width(hidden)), dtype=np.float32) for s in STAGE_BY_NAME.values()}
    return inputs, stages


def copy_stages(stages: dict[str, np.ndarray], drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    return {name: rows.copy() for name, rows in stages.items() if name not in drop}


def perturbed_from(stages: dict[str, np.ndarray], stage: str, change) -> dict[str, np.ndarray]:
    """A copy with `change(rows)` applied to `stage` and every later stage (a bug propagates downstream)."""
    start = STAGE_NAMES.index(stage)
    return {name: (change(rows) if STAGE_NAMES.index(name) >= start else rows.copy()).astype(np.float32)
            for name, rows in stages.items()}


def write_h5(path: Path, inputs: TraceInputs, stages: dict[str, np.ndarray], evidence: bool = True) -> Path:
    """An mtp-trace/1 file; with `evidence` (and an attn stage) it also records /evidence/attn_uniform as a
    reference needs it: attention sensitive at every t >= 1, as the oracle measures on distinct inputs."""
    record = {"attn_uniform": sensitive_uniform(stages["attn"])} if evidence and "attn" in stages else None
    write_trace(path, inputs, stages, {"producer": "test candidate"}, evidence=record)
    return path


def sensitive_uniform(attn: np.ndarray) -> np.ndarray:
    """A stand-in for attention with uniform weights: equal to attn at t=0 (one key), far from it elsewhere."""
    uniform = (attn + 1).astype(np.float32)
    uniform[:1] = attn[:1]
    return uniform


def write_raw(path: Path, stages: dict[str, np.ndarray], inputs: TraceInputs | None = None,
              hidden: bool = True) -> Path:
    """A raw candidate directory: `<stage>.bin` (little-endian float32), optional inputs.json and hidden.bin."""
    path.mkdir(parents=True, exist_ok=True)
    for name, rows in stages.items():
        rows.astype("<f4").tofile(path / f"{name}.bin")
    if inputs is not None:
        (path / "inputs.json").write_text(json.dumps({"token_ids": inputs.token_ids.tolist(),
                                                      "positions": inputs.positions.tolist()}))
        if hidden:
            inputs.hidden.astype("<f4").tofile(path / "hidden.bin")
    return path


def diff_cli(*args) -> "click.testing.Result":
    """Run `mtp-probe diff ARGS`; assert no traceback and that the last line is a summary or an Error (a usage error;
    a user-fixable one ends with its `INVALID | …` line, not repeated as `Error:` where both streams are read)."""
    result = run_cli(cli, ["diff", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    last = result.output.rstrip("\n").splitlines()[-1]
    if result.exit_code == 2 and last.startswith("Error:"):
        return result
    assert last.startswith(VERDICT_WORDS), result.output
    return result


def last_line(result) -> str:
    return result.output.rstrip("\n").splitlines()[-1]
