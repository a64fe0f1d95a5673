"""Reading a file the user names, without trusting it: regular files only, and JSON parsed within limits.

A FIFO, a device or a socket given where a file belongs would block the reader forever (a FIFO with no writer) or
read without end (/dev/zero), so a path is stat-ed before it is opened and anything but a regular file (a symlink to
one is followed) is refused. JSON is parsed by one function with limits: a file size, a nesting depth, integers of
at most 4300 digits (Python's own limit, which otherwise surfaces as a ValueError from deep inside json), finite
numbers only (1e400 and NaN/Infinity are no configuration value or tolerance), and no key given twice (json keeps
the last silently). Every refusal is the caller's error class (an MtpError: exit 2), naming the file.
"""

import json
import math
import os
import stat
from pathlib import Path

from oracle.errors import InputError, MtpError

MAX_JSON_BYTES = 256 << 20  # far above any config.json, index, profile or safetensors header (its library: 100 MB)
MAX_JSON_DEPTH = 64  # objects and arrays nested; the deepest file the project reads nests 4
MAX_INT_DIGITS = 4300  # CPython's default int-from-string limit (sys.int_info.default_max_str_digits)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((text for test, text in kinds if test(mode)), "not a regular file")


def check_regular_file(path: Path, what: str, error: type[MtpError] = InputError) -> int:
    """The size of `path` when it is a regular file (or a symlink to one); else `error`, naming it as `what`.
    Nothing is opened: opening a FIFO blocks until a writer comes."""
    try:
        mode, size = (lambda st: (st.st_mode, st.st_size))(os.stat(path))
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist.") from None
    except OSError as err:  # a symlink loop, no permission on a folder, a name too long
        raise error(f"cannot read {what} {path}: {err.strerror or err}.") from None
    if not stat.S_ISREG(mode):
        raise error(f"cannot read {what} {path}: it is {file_kind(mode)}, not a regular file; give the path of the "
                    f"file itself.")
    return size


class _Refused(ValueError):
    """A value the limits refuse, raised from inside json's parser."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is beyond float range")
    return value


def _parse_constant(text: str):
    raise _Refused(f"{text} is not a JSON number (NaN and Infinity are not allowed)")


def _no_repeated_keys(pairs: list) -> dict:
    found = {}
    for key, value in pairs:
        if key in found:
            raise _Refused(f"the key {key!r:.80} is given twice")
        found[key] = value
    return found


def loads_json(text: str | bytes, where: str, error: type[MtpError] = InputError):
    """`text` parsed as JSON within the limits (module docstring); `error` naming `where` otherwise."""
    try:
        data = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                          object_pairs_hook=_no_repeated_keys)
    except _Refused as err:
        raise error(f"{where} is refused: {err}. Fix or regenerate the file.") from None
    except RecursionError:
        raise error(f"{where} is not usable JSON: it nests deeper than {MAX_JSON_DEPTH} levels.") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise error(f"{where} is not valid JSON ({err}).") from None
    depth = _depth(data)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{where} is not usable JSON: it nests {depth} levels deep (at most {MAX_JSON_DEPTH}).")
    return data


def read_json(path: Path, what: str, error: type[MtpError] = InputError, max_bytes: int = MAX_JSON_BYTES):
    """The JSON in the regular file `path` (`what` names it in messages), within the limits."""
    size = check_regular_file(path, what, error)
    if size > max_bytes:
        raise error(f"{what} {path} is {size} bytes; a JSON file here is at most {max_bytes} bytes.")
    try:
        with open(path, "rb") as f:
            text = f.read(max_bytes + 1)
    except OSError as err:  # no permission, an I/O error, removed meanwhile
        raise error(f"cannot read {what} {path}: {err.strerror or err}.") from None
    if len(text) > max_bytes:  # it grew since the stat
        raise error(f"{what} {path} is over {max_bytes} bytes; a JSON file here is at most that.")
    return loads_json(text, f"{what} {path}", error)


def _depth(data) -> int:
    """Nesting depth of parsed JSON (a scalar: 0), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:  # deeper is refused anyway: no need to walk it all
            stack.extend((child, level + 1) for child in children)
    return deepest
