"""Text that came from a file (a trace's attributes, a path) as the CLIs show it on a terminal or a verdict line.

A trace or a candidate folder can hold any string: an ANSI escape sequence would act on the user's terminal (clear
it, retitle the window), a bidi override would reorder what is read, and a newline in a path would let a line that
reads "PASSED | ..." follow the real verdict line that CI greps. Such characters are shown escaped instead."""

import re

# C0 controls (but tab and newline, which `printable` may keep), DEL, C1 controls, bidi marks, embeddings, overrides
# and isolates
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_LINE_BREAKS = re.compile("[\t\n]")


def printable(text: str, keep_lines: bool = False) -> str:
    """`text` with every control or bidi-formatting character escaped as Python writes it (\\x1b, \\u202e); tabs
    and newlines too unless `keep_lines` (a multi-line report whose own layout uses them)."""
    escaped = _UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)
    return escaped if keep_lines else _LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], escaped)


def clipped(text: str, limit: int = 600) -> str:
    """`text` up to about `limit` characters, cut after a whole item (at ", " or a line end), never mid-word, with
    how much was left out."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(", ", 0, limit), text.rfind("\n", 0, limit))
    cut = cut if cut > limit // 2 else text.rfind(" ", 0, limit)
    head = text[:cut if cut > 0 else limit].rstrip(", \n")
    return f"{head} … ({len(text) - len(head)} more characters)"
