"""`mtp-oracle inputs REF --out-dir D`: a reference's step inputs as the raw files an engine harness reads.

For engines that dump their stages instead of being driven through the C ABI: the harness feeds step i the
reference's own inputs (token id t_{i+1}, position p_i, hidden H_i, and, for an engine that does not look up its own
embedding table, the embedding row), then writes its stages as a raw directory (probe/adapters/trace_file.py)
for `mtp-probe diff`. Files written in D, each atomically (temporary name, then rename):

    inputs.json   {"token_ids": [T ints], "positions": [T ints]}    (the keys a raw trace directory accepts)
    hidden.bin    H [T, W]   little-endian float32, row-major       (the main model's post-final-norm hidden; W = D,
                                                                    hc·D for a hyper-connection head: DeepSeek-V4)
    embed.bin     [T, D]     little-endian float32, row-major       (embedding rows of token_ids, as stored)

Copy inputs.json and hidden.bin into the engine's dump directory and the probe checks that the engine consumed
exactly these inputs; embed.bin is an input only (the probe reads no embed.bin in a dump directory).
"""

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from oracle.errors import OutputError
from oracle.output import atomic_output
from oracle.trace import TraceInputs, read_trace

INPUT_FILES = ("inputs.json", "hidden.bin", "embed.bin")


def dump_inputs(ref: Path, out_dir: Path) -> list[Path]:
    """Write REF's step inputs into `out_dir` (created if needed); returns the paths written, INPUT_FILES order.

    Refuses (OutputError) to write over the reference itself or into a path that is not a directory."""
    ref, out_dir = Path(ref), Path(out_dir)
    with read_trace(ref) as reader:
        inputs = reader.verified_inputs()  # an edited reference is refused, as the probe refuses it
    targets = [out_dir / name for name in INPUT_FILES]
    for target in targets:
        if target.exists() and os.path.samefile(target, ref):
            raise OutputError(f"--out-dir {out_dir}: {target} is the reference trace itself; choose another "
                              f"directory (nothing was written).")
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"--out-dir {out_dir} is a file; give a directory (it is created if missing).")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"--out-dir {out_dir} cannot be created: {err}.") from None
    writers = {"inputs.json": _write_ids, "hidden.bin": _rows_writer("hidden"), "embed.bin": _rows_writer("embed")}
    with contextlib.ExitStack() as stack:  # all three written before any is published: never a partial set
        for target in targets:
            writers[target.name](inputs, stack.enter_context(atomic_output(target, "--out-dir")))
    return targets


def shapes_text(ref: Path) -> str:
    """What each row file holds, measured from REF: `hidden.bin [T, hc·D] = [8, 256], embed.bin [T, D] = [8, 64]`
    (hc·D only where the hidden is wider than the embedding rows: DeepSeek-V4's hc streams)."""
    with read_trace(ref) as reader:
        t, d, width = reader.num_tokens, reader.hidden_size, reader.input_shape("hidden")[1]
    hidden = "T, D" if width == d else ("T, hc·D" if width % d == 0 else "T, W")
    return f"hidden.bin [{hidden}] = [{t}, {width}], embed.bin [T, D] = [{t}, {d}]"


def _write_ids(inputs: TraceInputs, path: Path) -> None:
    text = json.dumps({"token_ids": inputs.token_ids.tolist(), "positions": inputs.positions.tolist()}) + "\n"
    _write_bytes(path, text.encode())


def _rows_writer(name: str):
    def write(inputs: TraceInputs, path: Path) -> None:
        _write_bytes(path, np.ascontiguousarray(getattr(inputs, name), dtype="<f4"))  # native -> little-endian f32
    return write


def _write_bytes(path: Path, data) -> None:
    """`data` (bytes or an array) written to `path` with checked write calls and an fsync: a full disk raises
    OSError(ENOSPC), which atomic_output reports as "no space left". (ndarray.tofile lost that error: a 0-byte
    hidden.bin on a full tmpfs, exit 0.)"""
    view = memoryview(data).cast("B")
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < len(view):
            done += f.write(view[done:])
        os.fsync(f.fileno())  # a filesystem that allocates at writeback reports ENOSPC here
