"""The oracle's inputs: step token ids, main-model hidden states and positions, from the user's options.

Step i consumes token t_{i+1} (the `--tokens` list is already shifted), hidden H_i and position p_i = start + i.
Hidden comes from a file (.npy float32 [T, D], raw little-endian float32 .bin [T, D], or FILE.h5:/dataset; the row
width is the family's hidden width, hc·D for DeepSeek-V4's streams), from a seed (synthetic), or from the
checkpoint's main model run over (x_0, t_1, ..., t_{T-1}) (the family's `main_model_hidden`).
"""

import functools
import re
from pathlib import Path

import numpy as np

from oracle.errors import InputError
from oracle.reading import check_regular_file
from oracle.trace import array_from_hdf5

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def token_ids_from_text(text: str, source: str) -> np.ndarray:
    """Token ids from '5,17,3' or whitespace/comma separated text; at least one. An empty item ('17,,42', a
    trailing comma) is refused, not skipped: a dropped id would shift every later step."""
    if not text.strip():
        raise InputError(f"{source}: no token ids given; pass e.g. --tokens 5,17,3.")
    fields = re.split(r"\s*,\s*|\s+", text.strip())
    empty = next((i for i, f in enumerate(fields) if not f), None)
    if empty is not None:
        raise InputError(f"{source}: item {empty + 1} (of {len(fields)}) is empty (two commas in a row, or a "
                         f"leading or trailing comma); give one id between each pair of commas, e.g. 5,17,3.")
    bad = next((f for f in fields if not re.fullmatch(r"[+-]?[0-9]+", f)), None)
    if bad is not None:
        ascii_hint = " (ASCII digits 0-9 only)" if re.fullmatch(r"[+-]?\d+", bad) else ""
        raise InputError(f"{source}: {bad!r} is not an integer token id{ascii_hint}.")
    row = next((i for i, f in enumerate(fields) if len(f.lstrip("+-").lstrip("0")) > 19), None)
    if row is not None:  # int() of over 4300 digits is Python's own ValueError; any id past 19 digits is past int64
        shown = fields[row] if len(fields[row]) <= 40 else f"{fields[row][:24]}… ({len(fields[row])} characters)"
        raise InputError(f"{source}: token id {shown} at row {row} does not fit in int64 (and is beyond any "
                         f"vocabulary); token ids must be in 0..vocab_size-1.")
    values = [int(f) for f in fields]
    _check_int64(values, source)
    return np.array(values, dtype=np.int64)


def token_ids_from_array(values, source: str = "token_ids") -> np.ndarray:
    """Token ids passed in code (export_trace's `token_ids`, measure_acceptance's `sequence`): a 1-D integer array
    or list, checked as the CLI checks --tokens-file; never cast from floats, bools or text."""
    arr = np.asarray(values) if not isinstance(values, (str, bytes)) else np.asarray(values, dtype=object)
    if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        hint = (" Parse text with oracle.inputs.token_ids_from_text." if arr.dtype.kind in "OUS" else
                " Cast whole-number ids with .astype(np.int64) yourself." if arr.dtype.kind == "f" else
                " Pass one sequence of T ids (e.g. ids[0] of a batch of one)." if arr.ndim > 1 else "")
        raise InputError(f"{source} must be a 1-D integer array of token ids (CLI: --tokens / --tokens-file), found "
                         f"{arr.dtype} of shape {arr.shape}.{hint}")
    if arr.size == 0:
        raise InputError(f"{source} holds no token ids; give at least one.")
    if arr.dtype == np.uint64 and arr.max() > INT64_MAX:  # astype would wrap it to a negative id
        _check_int64(arr.tolist(), source)
    return arr.astype(np.int64)


def _check_int64(values, source: str) -> None:
    """Token ids beyond int64 cannot be stored (and are beyond any vocabulary): refuse instead of wrapping."""
    for row, value in enumerate(values):
        if not INT64_MIN <= int(value) <= INT64_MAX:
            raise InputError(f"{source}: token id {value} at row {row} does not fit in int64 (and is beyond any "
                             f"vocabulary); token ids must be in 0..vocab_size-1.")


def token_ids_from_file(path: Path) -> np.ndarray:
    """Token ids from a .npy integer array or a text file of ids."""
    path = Path(path)
    if path.suffix == ".npy":
        arr = _load_npy(path)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{path}: token ids must be a 1-D integer array, found {arr.dtype} {arr.shape}.")
        if arr.size == 0:
            raise InputError(f"{path} holds no token ids; give at least one.")
        if arr.dtype == np.uint64 and arr.max() > INT64_MAX:  # astype would wrap it to a negative id
            _check_int64(arr.tolist(), str(path))
        return arr.astype(np.int64)
    check_regular_file(path, "tokens file")  # a FIFO would block the read forever
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path} is not UTF-8 text (byte {err.start}); a tokens file holds ids as text "
                         f"(comma or whitespace separated) or is a .npy int array.") from None
    except OSError as err:
        raise InputError(f"cannot read tokens file {path}: {err.strerror or err}.") from None
    if not text.strip():
        raise InputError(f"{path} is empty; a tokens file holds at least one id (comma or whitespace separated).")
    return token_ids_from_text(text, str(path))


def positions_from_start(num_tokens: int, start_pos: int) -> np.ndarray:
    """Positions start .. start+T-1 (the export checks first that RoPE can represent them: oracle/limits.py)."""
    if start_pos < 0:
        raise InputError(f"--start-pos {start_pos} is negative; positions start at 0 or later.")
    if start_pos + num_tokens - 1 > INT64_MAX:  # np.arange would wrap around to negative positions
        raise InputError(f"--start-pos {start_pos}: positions up to {start_pos + num_tokens - 1} do not fit in "
                         f"int64.")
    return np.arange(start_pos, start_pos + num_tokens, dtype=np.int64)


def hidden_from_seed(seed: int, num_tokens: int, hidden_size: int) -> np.ndarray:
    """Synthetic H: rows of standard normals, i.e. unit RMS like a post-final-norm hidden (up to its weight)."""
    if seed < 0:
        raise InputError(f"--hidden-seed {seed} is negative; give a seed of 0 or more.")
    return np.random.default_rng(seed).standard_normal((num_tokens, hidden_size), dtype=np.float32)


def hidden_from_file(spec: str, num_tokens: int, hidden_size: int, streams: int = 1) -> np.ndarray:
    """H [T, D] float32 from FILE.npy, FILE.bin (raw little-endian float32) or FILE.h5:/dataset. `hidden_size` is
    the row width: D, or hc·D for a head fed `streams` = hc_mult residual streams (DeepSeek-V4)."""
    path, dataset = _split_h5_spec(spec)
    if dataset is not None:
        where = f"{path}:{dataset}"
        layout = functools.partial(_check_hidden_layout, where=where, num_tokens=num_tokens, hidden_size=hidden_size,
                                   streams=streams)  # before the read: a claim of 1e9 rows is never allocated
        arr = np.asarray(array_from_hdf5(path, dataset, check=lambda shape, dtype: layout(dtype, shape)))
    elif path.suffix == ".npy":
        shape, dtype = npy_claims(path)
        _check_hidden_layout(dtype, shape, str(path), num_tokens, hidden_size, streams)  # before it is loaded
        arr, where = _load_npy(path), str(path)
    elif path.suffix == ".bin":
        arr, where = _load_bin(path, num_tokens, hidden_size), str(path)
    else:
        raise InputError(f"--hidden {spec}: unknown format; use .npy, .bin (raw little-endian float32) "
                         f"or FILE.h5:/dataset.")
    return _checked_hidden(arr, where, num_tokens, hidden_size, streams)


def hidden_file_path(spec: str) -> Path:
    """The file a --hidden spec reads (FILE of FILE.h5:/dataset), e.g. to refuse an output path onto it."""
    match = re.fullmatch(r"(.+\.(?:h5|hdf5)):(/.*)", spec)
    return Path(match.group(1) if match else spec)


def _split_h5_spec(spec: str) -> tuple[Path, str | None]:
    match = re.fullmatch(r"(.+\.(?:h5|hdf5)):(/.*)", spec)
    if match:
        return Path(match.group(1)), match.group(2)
    if re.search(r"\.(h5|hdf5)$", spec):
        raise InputError(f"--hidden {spec}: name the dataset too, as {spec}:/path/to/dataset.")
    return Path(spec), None


def _check_hidden_layout(dtype: np.dtype, shape: tuple[int, ...], where: str, num_tokens: int, hidden_size: int,
                         streams: int = 1) -> None:
    """The hidden's dtype and shape, float32 [T, D] (D: the row width), checked before or after it is read."""
    if dtype != np.float32:
        kind = {"S": "bytes", "U": "text", "O": "objects (strings?)", "V": "a compound type"}.get(dtype.kind)
        raise InputError(f"{where} is {kind or dtype}; the hidden must be float32 [T, D]. Convert it explicitly "
                         f"(the oracle does not cast silently).")
    if len(shape) != 2 or shape[1] != hidden_size:
        width = (f"hidden_size is {hidden_size}" if streams == 1 else
                 f"hidden_size is {hidden_size // streams} and the head takes its hc_mult={streams} residual streams "
                 f"(the main model's last block output, flattened [T, hc·D])")
        raise InputError(f"{where} has shape {list(shape)}; the checkpoint's {width}, "
                         f"so it must be [T, {hidden_size}].")
    if shape[0] != num_tokens:
        raise InputError(f"{where} has {shape[0]} rows but {num_tokens} token ids were given; "
                         f"row i is H_i for step i, one row per token.")


def _load_npy(path: Path) -> np.ndarray:
    """One array from a .npy file, checked before it is loaded: a regular file, a .npy (not a .npz archive saved
    under that name), whose header claims no more data than the file holds (a claim of 1e9 rows is never allocated)."""
    npy_claims(path, InputError)
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"{path} is not a readable .npy file ({err}).") from None


def npy_claims(path: Path, error=InputError) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) a .npy file's header declares, after checking that the file is a regular .npy file that holds
    that much data; `error` naming it otherwise."""
    size = check_regular_file(path, ".npy file", error)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
            if magic != b"\x93NUMPY":
                what = ("a .npz archive (np.savez), not a .npy array" if magic.startswith(b"PK")
                        else "not a .npy file (no NUMPY magic)")
                raise error(f"{path} is {what}; save one array with np.save.")
            f.seek(0)
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
            data_start = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise error(f"{path} is not a readable .npy file ({err}).") from None
    claimed = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if not dtype.hasobject and data_start + claimed > size:
        raise error(f"{path}: its header claims {list(shape)} {dtype} ({claimed} bytes of data), but the file holds "
                    f"{size - data_start}; it is cut short or its header is wrong. Save it again with np.save.")
    return shape, dtype


def _load_bin(path: Path, num_tokens: int, hidden_size: int) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"{path} is not a file." if path.exists() else f"{path} does not exist.")
    expected = num_tokens * hidden_size * 4
    size = path.stat().st_size
    if size != expected:
        raise InputError(f"{path} has {size} bytes; T={num_tokens} tokens x D={hidden_size} float32 need "
                         f"{expected}. Check the token count and that the dump is float32 (not bf16/f16).")
    return np.fromfile(path, dtype="<f4").reshape(num_tokens, hidden_size)


def _checked_hidden(arr: np.ndarray, where: str, num_tokens: int, hidden_size: int, streams: int = 1) -> np.ndarray:
    _check_hidden_layout(arr.dtype, arr.shape, where, num_tokens, hidden_size, streams)
    bad = np.flatnonzero(~np.isfinite(arr).all(axis=1))
    if bad.size:
        raise InputError(f"{where}: row {int(bad[0])} holds NaN or Inf; the hidden must be finite.")
    return np.ascontiguousarray(arr, dtype="<f4").astype(np.float32, copy=False)
