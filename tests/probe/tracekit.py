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
    for name, rows in stages.items():  # float32; integer stages (topk_ids, draft) as int64
        rows.astype("<i8" if rows.dtype.kind in "iu" else "<f4").tofile(path / f"{name}.bin")
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


# --- Chains (issue 24): the schema's /chain groups written with h5py, as an engine team would ----------------------

def add_chain(path: Path, chain, recycle: str = "out", tokens: str = "teacher_forced") -> Path:
    """Add to the depth-1 trace at `path` (write_trace's) the draft stage with its margin, and the chain's depths
    (tests/probe/chain_reference.py `Chain`), with every digest the schema asks for, in place."""
    import h5py

    from oracle.trace import _put, chain_digest, evidence_digest, stage_checksums

    depths = sorted(chain.depths)
    with h5py.File(path, "a") as f:
        stages = [s.decode() if isinstance(s, bytes) else str(s) for s in f.attrs["stages"]]
        meta = {name: {k: f[f"stages/{name}"].attrs[k] for k in ("doc", "kind", "shape")} for name in stages}
        meta["draft"] = {"doc": "the draft token: argmax of lm_head(out)", "kind": "index_set", "shape": "Tx1"}
        _dataset(f, "stages/draft", chain.depth1["draft"], meta["draft"])
        _dataset(f, "evidence/draft_margin", chain.depth1["draft_margin"], {"row_norm_max": chain.row_norm_max})
        stages.append("draft")
        _put(f.attrs, "stages", stages)
        checksums = json.loads(f.attrs["stage_checksums"]) | {"draft": stage_checksums(
            {"draft": chain.depth1["draft"]})["draft"]}
        evidence = {name: f[f"evidence/{name}"][()] for name in f["evidence"]}
        for j in depths:
            part = chain.depths[j]
            for name, rows in part["inputs"].items():
                _dataset(f, f"chain/d{j}/inputs/{name}", rows)
            for name in stages:
                if name in part["stages"]:
                    _dataset(f, f"chain/d{j}/stages/{name}", part["stages"][name], meta[name])
                    checksums[f"d{j}/{name}"] = stage_checksums({name: part["stages"][name]})[name]
            for name, rows in part["evidence"].items():
                attrs = {"row_norm_max": chain.row_norm_max} if name == "draft_margin" else {}
                _dataset(f, f"chain/d{j}/evidence/{name}", rows, attrs)
                evidence[f"d{j}/{name}"] = rows
        _put(f.attrs, "stage_checksums", json.dumps(checksums, sort_keys=True))
        rules = json.loads(f.attrs["evidence_rules"]) if "evidence_rules" in f.attrs else None
        _put(f.attrs, "evidence_digest", evidence_digest(rules, evidence))
        _put(f.attrs, "chain_digest", chain_digest({j: chain.depths[j]["inputs"] for j in depths}))
        _put(f.attrs, "chain", json.dumps({"depths": max(depths), "tokens": tokens, "recycle": recycle,
                                           "layers": [0] * len(depths), "num_layers": 1,
                                           "kv": "dropped_after_chain"}, sort_keys=True))
    return path


def _dataset(f, name: str, rows: np.ndarray, attrs: dict | None = None) -> None:
    from oracle.trace import _put

    ds = f.create_dataset(name, data=rows)
    for key, value in (attrs or {}).items():
        _put(ds.attrs, key, value.decode() if isinstance(value, bytes) else value)


def write_chain_h5(path: Path, inputs: TraceInputs, stages: dict[str, np.ndarray],
                   depths: dict[int, dict[str, np.ndarray]]) -> Path:
    """A candidate trace: depth 1's `stages` (draft included, if given) and /chain/d{j}/stages/<name> per depth."""
    import h5py

    from oracle.stages import DRAFT

    float_stages = {n: r for n, r in stages.items() if n != "draft"}
    write_trace(path, inputs, float_stages, {"producer": "test candidate"})
    with h5py.File(path, "a") as f:
        if "draft" in stages:
            _dataset(f, "stages/draft", np.asarray(stages["draft"]), {"kind": DRAFT.kind, "shape": DRAFT.shape})
            f.attrs["stages"] = [*(s.decode() if isinstance(s, bytes) else s for s in f.attrs["stages"]), "draft"]
        for j, part in depths.items():
            for name, rows in part.items():
                _dataset(f, f"chain/d{j}/stages/{name}", np.asarray(rows))
    return path


def write_chain_raw(path: Path, stages: dict[str, np.ndarray], depths: dict[int, dict[str, np.ndarray]]) -> Path:
    """A raw dump: depth 1's <stage>.bin and d{j}/<stage>.bin (float32; the draft as int64)."""
    write_raw(path, stages)
    for j, part in depths.items():
        write_raw(path / f"d{j}", part)
    return path


def synthetic_chain(stages: dict[str, np.ndarray], depths: int, seed: int = 0):
    """A stand-in `Chain` (tests/probe/chain_reference.py) of random rows for long-trace renderings: depths 2..K
    with n_j rows, attention sensitive at every row, recycle alternatives far from h, margins of 1."""
    from tests.probe.chain_reference import Chain

    rng = np.random.default_rng(seed)
    total = len(stages["out"])

    def part(rows: int) -> dict:
        rows_of = {n: rng.standard_normal((rows, r.shape[1]), dtype=np.float32) for n, r in stages.items()}
        rows_of["draft"] = rng.integers(0, 100, (rows, 1))
        width = stages["h"].shape[1]
        return {"inputs": {"bridge": np.arange(rows), "token_ids": rng.integers(0, 100, rows),
                           "positions": np.arange(rows) + 1, "layer": np.zeros(rows, np.int64),
                           "recycled": rng.standard_normal((rows, width), dtype=np.float32),
                           "embed": rng.standard_normal((rows, width), dtype=np.float32)},
                "stages": rows_of,
                "evidence": {"attn_uniform": rows_of["attn"] + 1, "draft_margin": np.ones((rows, 1), np.float32),
                             "h_if_prenorm": rows_of["h"] + 1, "h_if_main": rows_of["h"] - 1}}

    depth1 = {"draft": rng.integers(0, 100, (total, 1)), "draft_margin": np.ones((total, 1), np.float32)}
    return Chain(depth1, {j: part(total - j + 1) for j in range(2, depths + 1)}, 1.0)
