"""The oracle's inputs: step token ids, main-model hidden states and positions, from the user's options.

Step i consumes token t_{i+1} (the `--tokens` list is already shifted), hidden H_i and position p_i = start + i.
Hidden comes from a file (.npy float32 [T, D], raw little-endian float32 .bin [T, D], or FILE.h5:/dataset), from
a seed (synthetic), or from the checkpoint's main model run over (x_0, t_1, ..., t_{T-1}).
"""

import re
from pathlib import Path

import numpy as np

from oracle.errors import InputError
from oracle.trace import array_from_hdf5


def token_ids_from_text(text: str, source: str) -> np.ndarray:
    """Token ids from '5,17,3' or whitespace/comma separated text; at least one."""
    fields = [f for f in re.split(r"[\s,]+", text.strip()) if f]
    if not fields:
        raise InputError(f"{source}: no token ids given; pass e.g. --tokens 5,17,3.")
    try:
        ids = np.array([int(f) for f in fields], dtype=np.int64)
    except ValueError:
        bad = next(f for f in fields if not re.fullmatch(r"-?\d+", f))
        raise InputError(f"{source}: {bad!r} is not an integer token id.") from None
    return ids


def token_ids_from_file(path: Path) -> np.ndarray:
    """Token ids from a .npy integer array or a text file of ids."""
    path = Path(path)
    if path.suffix == ".npy":
        arr = _load_npy(path)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{path}: token ids must be a 1-D integer array, found {arr.dtype} {arr.shape}.")
        return arr.astype(np.int64)
    return token_ids_from_text(path.read_text(), str(path))


def positions_from_start(num_tokens: int, start_pos: int) -> np.ndarray:
    if start_pos < 0:
        raise InputError(f"--start-pos {start_pos} is negative; positions start at 0 or later.")
    return np.arange(start_pos, start_pos + num_tokens, dtype=np.int64)


def hidden_from_seed(seed: int, num_tokens: int, hidden_size: int) -> np.ndarray:
    """Synthetic H: rows of standard normals, i.e. unit RMS like a post-final-norm hidden (up to its weight)."""
    return np.random.default_rng(seed).standard_normal((num_tokens, hidden_size), dtype=np.float32)


def hidden_from_file(spec: str, num_tokens: int, hidden_size: int) -> np.ndarray:
    """H [T, D] float32 from FILE.npy, FILE.bin (raw little-endian float32) or FILE.h5:/dataset."""
    path, dataset = _split_h5_spec(spec)
    if dataset is not None:
        arr = array_from_hdf5(path, dataset)
        where = f"{path}:{dataset}"
    elif path.suffix == ".npy":
        arr, where = _load_npy(path), str(path)
    elif path.suffix == ".bin":
        arr, where = _load_bin(path, num_tokens, hidden_size), str(path)
    else:
        raise InputError(f"--hidden {spec}: unknown format; use .npy, .bin (raw little-endian float32) "
                         f"or FILE.h5:/dataset.")
    return _checked_hidden(arr, where, num_tokens, hidden_size)


def _split_h5_spec(spec: str) -> tuple[Path, str | None]:
    match = re.fullmatch(r"(.+\.(?:h5|hdf5)):(/.*)", spec)
    if match:
        return Path(match.group(1)), match.group(2)
    if re.search(r"\.(h5|hdf5)$", spec):
        raise InputError(f"--hidden {spec}: name the dataset too, as {spec}:/path/to/dataset.")
    return Path(spec), None


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"{path} does not exist.")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise InputError(f"{path} is not a readable .npy file ({err}).") from None


def _load_bin(path: Path, num_tokens: int, hidden_size: int) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"{path} does not exist.")
    expected = num_tokens * hidden_size * 4
    size = path.stat().st_size
    if size != expected:
        raise InputError(f"{path} has {size} bytes; T={num_tokens} tokens x D={hidden_size} float32 need "
                         f"{expected}. Check the token count and that the dump is float32 (not bf16/f16).")
    return np.fromfile(path, dtype="<f4").reshape(num_tokens, hidden_size)


def _checked_hidden(arr: np.ndarray, where: str, num_tokens: int, hidden_size: int) -> np.ndarray:
    if arr.dtype != np.float32:
        raise InputError(f"{where} is {arr.dtype}; the hidden must be float32 [T, D]. Convert it explicitly "
                         f"(the oracle does not cast silently).")
    if arr.ndim != 2 or arr.shape[1] != hidden_size:
        raise InputError(f"{where} has shape {list(arr.shape)}; the checkpoint's hidden_size is {hidden_size}, "
                         f"so it must be [T, {hidden_size}].")
    if arr.shape[0] != num_tokens:
        raise InputError(f"{where} has {arr.shape[0]} rows but {num_tokens} token ids were given; "
                         f"row i is H_i for step i, one row per token.")
    bad = np.flatnonzero(~np.isfinite(arr).all(axis=1))
    if bad.size:
        raise InputError(f"{where}: row {int(bad[0])} holds NaN or Inf; the hidden must be finite.")
    return np.ascontiguousarray(arr, dtype="<f4").astype(np.float32, copy=False)
