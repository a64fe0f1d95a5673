"""Tolerances: one default, optional command-line overrides, each carrying the reason it exists.

A (stage, token) row passes iff `max_rel < rtol` or `max_abs < atol` (the rule: probe/rule.py `RULE`). A zero
tolerance means exact equality.
"""

import math
from dataclasses import dataclass
from typing import Iterable

from oracle.stages import KNOWN_STAGE_NAMES

from probe.errors import ToleranceError


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float
    why: str

    def __post_init__(self) -> None:
        for name, value in (("rtol", self.rtol), ("atol", self.atol)):
            if not (math.isfinite(value) and value >= 0):
                raise ToleranceError(f"{name}={value} ({self.why}): a tolerance must be a finite number >= 0.")


# DESIGN.md: a float32 engine against the float32 oracle, per (stage, token) row.
DEFAULT = Tol(rtol=1e-4, atol=1e-5, why="default for a float32 candidate against the float32 oracle")
# bf16 keeps 8 significant bits (unit roundoff 3.9e-3); on the tiny fixture the bf16 torch candidate reaches
# max_rel 1.4e-2 (mlp). 5e-2 leaves margin for longer dot products. The price: errors below ~5% of a row's
# magnitude (a wrong rotary span, a frozen position) pass unseen, so check wiring with a float32 build first.
PROFILES = {
    "float32": DEFAULT,
    "bfloat16": Tol(rtol=5e-2, atol=1e-3, why="bfloat16 profile: blind to errors below ~5% of a row's magnitude"),
}


def stage_tol_from_text(text: str) -> tuple[str, Tol]:
    """Parse one `--stage-tol STAGE=RTOL,ATOL` value, e.g. `fc=1e-3,1e-4`."""
    name, sep, numbers = text.partition("=")
    name = name.strip()
    if name not in KNOWN_STAGE_NAMES:
        raise ToleranceError(f"--stage-tol {text}: unknown stage '{name}'; valid stages are "
                             f"{', '.join(KNOWN_STAGE_NAMES)}.")
    parts = numbers.split(",")
    try:
        rtol, atol = (float(p) for p in parts) if sep and len(parts) == 2 else (None, None)
    except ValueError:
        rtol = atol = None
    if rtol is None or atol is None:
        raise ToleranceError(f"--stage-tol {text}: expected STAGE=RTOL,ATOL with both numbers, e.g. {name}=1e-3,1e-4.")
    return name, Tol(rtol, atol, f"--stage-tol {text.strip()}")


class TolTable(dict):
    """Stage name -> Tol: the overrides given, `base` for every other stage (whatever the family's stage list)."""

    def __init__(self, base: Tol, overrides: dict[str, Tol]):
        super().__init__(overrides)
        self.base = base

    def __missing__(self, name: str) -> Tol:
        return self.base

    def __bool__(self) -> bool:  # a table with no overrides is still a table (never "no tolerances")
        return True

    def for_stages(self, names) -> dict[str, Tol]:
        """The table restricted to `names`, in their order."""
        return {name: self[name] for name in names}


def tol_table(base: Tol = DEFAULT, overrides: Iterable[str] = ()) -> TolTable:
    """The tolerance of every stage: `base`, replaced per stage by `--stage-tol` overrides (each stage once)."""
    table = TolTable(base, {})
    seen: set[str] = set()
    for text in overrides:
        name, tol = stage_tol_from_text(text)
        if name in seen:
            raise ToleranceError(f"--stage-tol gives stage '{name}' more than once; keep one value per stage.")
        seen.add(name)
        table[name] = tol
    return table
