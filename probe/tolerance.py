"""Tolerances: one default, optional command-line overrides, each carrying the reason it exists.

A (stage, token) row passes iff `max_rel < rtol` or `max_abs < atol` (the rule: probe/rule.py `RULE`). A zero
tolerance means exact equality.

The base is a named profile (`--profile float32|bfloat16`, fixed numbers) or a measured one (`--profile
FILE[:PATH]`): the per-stage tolerances `mtp-oracle noise` wrote for one computation path (oracle/noise.py), checked
against the reference (family, head digest, stages) and stated in the report (`TolTable.noise`).
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from oracle.stages import KNOWN_STAGE_NAMES, LEGACY_FAMILY

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
    return name, user_tol(rtol, atol, f"--stage-tol {text.strip()}")


def user_tol(rtol: float, atol: float, why: str) -> Tol:
    """A tolerance given on the command line. An rtol of 1 or more passes a row of any sign and nearly any size (a
    candidate's mlp x -3 passed at --rtol 10): it checks nothing, and is refused, as a measured profile giving one
    is (measured_tol)."""
    tol = Tol(rtol, atol, why)
    if rtol >= 1:
        raise ToleranceError(f"{why}: rtol {rtol:g} is >= 100% of the row, which passes a row of any sign and "
                             f"almost any size: it checks nothing. Give an rtol below 1 (bfloat16 engines: "
                             f"--profile bfloat16, or a measured profile from mtp-oracle noise).")
    return tol


@dataclass(frozen=True)
class NoiseFloor:
    """The measured noise profile a table's tolerances came from, as the report states it."""

    file: str
    path: str  # the computation path: float32, bfloat16 or float16
    margin: float
    family: str
    num_tokens: int
    same_inputs: bool | None  # measured on the reference's own inputs (None: the reference records no digest)
    unit_roundoff: float | None
    stages: dict  # stage -> the profile's figures for it (measured_max_rel, measured_max_abs, rtol, atol)

    def to_json(self) -> dict:
        return {"file": self.file, "path": self.path, "margin": self.margin, "family": self.family,
                "num_tokens": self.num_tokens, "same_inputs": self.same_inputs, "unit_roundoff": self.unit_roundoff,
                "stages": self.stages}


class StageTols(dict):
    """Stage name -> Tol for one reference's stages, with the noise profile they came from (None: none)."""

    noise: NoiseFloor | None = None


class TolTable(dict):
    """Stage name -> Tol: the overrides given, `base` for every other stage (whatever the family's stage list)."""

    noise: NoiseFloor | None = None  # set when the tolerances are a measured profile's

    def __init__(self, base: Tol, overrides: dict[str, Tol]):
        super().__init__(overrides)
        self.base = base

    def __missing__(self, name: str) -> Tol:
        return self.base

    def __bool__(self) -> bool:  # a table with no overrides is still a table (never "no tolerances")
        return True

    def for_stages(self, names) -> dict[str, Tol]:
        """The table restricted to `names`, in their order."""
        tols = StageTols({name: self[name] for name in names})
        tols.noise = self.noise
        return tols


def tol_table(base: Tol = DEFAULT, overrides: Iterable[str] = (), measured: TolTable | None = None) -> TolTable:
    """The tolerance of every stage: `base` (or the `measured` profile's table), replaced per stage by
    `--stage-tol` overrides (each stage once)."""
    table = measured if measured is not None else TolTable(base, {})
    seen: set[str] = set()
    for text in overrides:
        name, tol = stage_tol_from_text(text)
        if name in seen:
            raise ToleranceError(f"--stage-tol gives stage '{name}' more than once; keep one value per stage.")
        seen.add(name)
        table[name] = tol
    return table


# --- Measured profiles (`mtp-oracle noise`, oracle/noise.py): the file's schema, read without the oracle. ---
NOISE_SCHEMA = "mtp-noise-profile/1"
_REGENERATE = ("measure one on the reference's checkpoint and inputs with: mtp-oracle noise CHECKPOINT --tokens ... "
               "(--hidden FILE | --hidden-seed N) --out noise.json")


def profile_file_spec(text: str) -> tuple[Path, str | None] | None:
    """`--profile` as (FILE, PATH or None) for FILE[:PATH]; None for a named profile. A file that exists under the
    whole text keeps any colon in its name."""
    if text in PROFILES:
        return None
    file, sep, path = text.rpartition(":")
    if sep and file and not Path(text).exists():
        return Path(file), path
    if os.path.lexists(text) and not Path(text).is_file():  # a FIFO, a directory: say what it is, never open it
        from oracle.reading import check_regular_file

        check_regular_file(Path(text), "--profile file", ToleranceError)
    if not Path(text).is_file():
        raise ToleranceError(f"--profile {text}: neither a named profile ({', '.join(sorted(PROFILES))}) nor an "
                             f"existing noise-profile file (FILE[:PATH]); {_REGENERATE}.")
    return Path(text), None


def reference_facts(ref: Path) -> dict:
    """What a measured profile is checked against: the reference trace's family, stages and digests."""
    from oracle.trace import read_trace

    with read_trace(ref) as trace:
        stage_list = trace.stage_list
        return {"name": str(ref), "family": trace.attrs.get("family", LEGACY_FAMILY), "stages": list(stage_list.names),
                "kinds": {s.name: s.kind for s in stage_list},
                "checkpoint_digest": trace.attrs.get("checkpoint_digest"),
                "inputs_digest": trace.attrs.get("inputs_digest")}


def measured_tol_table(file: Path, path: str | None, reference: dict) -> TolTable:
    """The tolerances a noise profile measured for computation `path` (default bfloat16, or its only path), one
    per stage of `reference` (reference_facts). Refused with a ToleranceError: an unreadable file, another schema,
    family or head, a path it did not measure, a reference stage it does not cover."""
    profile = _read_profile(file)
    where = f"--profile {file}"
    if not isinstance(profile.get("family"), str):
        raise ToleranceError(f"{where} does not say which family's head it measured (no family): a damaged file; "
                             f"{_REGENERATE}.")
    if profile.get("family") != reference["family"]:
        raise ToleranceError(f"{where} was measured on a {profile.get('family')} head; the reference "
                             f"{reference['name']} is a {reference['family']} head: {_REGENERATE}.")
    ours, theirs = profile.get("checkpoint_digest"), reference.get("checkpoint_digest")
    if theirs and not ours:
        raise ToleranceError(f"{where} does not say which head it measured (no checkpoint_digest), so it cannot be "
                             f"checked against the reference {reference['name']}: {_REGENERATE}.")
    if ours and theirs and ours != theirs:
        raise ToleranceError(f"{where} was measured on the head in {profile.get('checkpoint')} (digest {ours}); the "
                             f"reference {reference['name']} was exported from another head (digest {theirs}). "
                             f"The noise depends on the weights: {_REGENERATE}.")
    path, figures = _chosen_path(profile, path, where)
    return _measured_table(file, path, profile, _covered(figures, reference, f"{where}:{path}"), reference)


def _read_profile(file: Path) -> dict:
    from oracle.reading import read_json

    try:
        profile = read_json(Path(file), "--profile", ToleranceError)  # a regular file, JSON within limits
    except ToleranceError as err:
        why = str(err).removeprefix(f"--profile {file} ").rstrip(".")
        raise ToleranceError(f"--profile {file}: cannot read it as a noise profile ({why}); {_REGENERATE}.") from None
    schema = profile.get("schema") if isinstance(profile, dict) else None
    if schema != NOISE_SCHEMA:
        raise ToleranceError(f"--profile {file}: schema {schema!r}, this probe reads {NOISE_SCHEMA}; {_REGENERATE}.")
    from oracle.noise import DIGEST_KEY, profile_digest  # torch-free

    recorded = profile.get(DIGEST_KEY)
    if recorded is None:
        raise ToleranceError(f"--profile {file} has no {DIGEST_KEY}: written before profiles carried one, or edited; "
                             f"its tolerances cannot be trusted. {_REGENERATE[0].upper()}{_REGENERATE[1:]}.")
    try:
        actual = profile_digest(profile)
    except ValueError:  # NaN or Inf in the file: never written by mtp-oracle noise
        actual = None
    if recorded != actual:
        raise ToleranceError(f"--profile {file}: its contents do not match its {DIGEST_KEY} ({str(recorded)[:19]}…): "
                             f"the profile was edited or damaged after it was measured, and its figures set what "
                             f"passes. {_REGENERATE[0].upper()}{_REGENERATE[1:]}.")
    return profile


def _chosen_path(profile: dict, path: str | None, where: str) -> tuple[str, dict]:
    paths = profile.get("paths") if isinstance(profile.get("paths"), dict) else {}
    if path is None:
        path = "bfloat16" if "bfloat16" in paths or len(paths) != 1 else next(iter(paths))
    if path not in paths:
        raise ToleranceError(f"{where}:{path}: the profile measured {', '.join(paths) or 'no path'}; name one as "
                             f"--profile FILE:PATH.")
    figures = paths[path]
    if not isinstance(figures, dict) or not isinstance(figures.get("stages"), dict):
        raise ToleranceError(f"{where}: path {path} has no per-stage figures (a damaged file); {_REGENERATE}.")
    return path, figures


def _covered(figures: dict, reference: dict, where: str) -> dict:
    """The path's per-stage figures, every reference stage present and measured finite."""
    stages = figures["stages"]
    missing = [n for n in reference["stages"] if n not in stages]
    if missing:
        raise ToleranceError(f"{where}: the reference's stages {', '.join(missing)} are not in the profile (it has "
                             f"{', '.join(stages)}); {_REGENERATE}.")
    overflowed = [n for n in reference["stages"] if isinstance(stages[n], dict) and stages[n].get("nonfinite_rows")]
    if overflowed:
        raise ToleranceError(f"{where}: this path computed NaN/Inf at {', '.join(overflowed)} (overflow), so it "
                             f"measured no noise floor there; pick another path (--profile FILE:PATH).")
    return stages


def _measured_table(file: Path, path: str, profile: dict, stages: dict, reference: dict) -> TolTable:
    where = f"--profile {file}:{path}"
    u = _number(profile["paths"][path].get("unit_roundoff"), f"{where}: unit_roundoff", low=0.0, high=1.0)
    margin = _number(profile.get("margin"), f"{where}: margin", low=1.0)
    table = TolTable(DEFAULT, {name: _measured_tol(where, path, margin, u, stages[name], reference["kinds"].get(name))
                               for name in reference["stages"]})
    digest = reference.get("inputs_digest")
    inputs = profile.get("inputs") if isinstance(profile.get("inputs"), dict) else {}
    num_tokens = inputs.get("num_tokens", 0)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ToleranceError(f"{where}: inputs.num_tokens is {num_tokens!r}, not a token count (a damaged file); "
                             f"{_REGENERATE}.")
    table.noise = NoiseFloor(str(file), path, margin, profile["family"], num_tokens,
                             None if not digest else inputs.get("inputs_digest") == digest, u,
                             {name: stages[name] for name in reference["stages"]})
    return table


def _measured_tol(where: str, path: str, margin: float, u: float, entry, kind: str | None) -> Tol:
    """The stage's tolerance, recomputed from its measured figures by the profile's own rule (rtol = margin x
    max(measured max_rel, u); atol at most rtol x the smallest row's scale, or margin x the measured max_abs for
    all-zero rows): a profile whose stated tolerances disagree with its figures, or that would check nothing (rtol
    >= 1), is refused, never trusted (an edited profile passed a candidate 30% off at attn)."""
    if kind == "index_set":
        return Tol(0.0, 0.0, "index set: compared as a set, no float tolerance")
    if not isinstance(entry, dict):
        raise ToleranceError(f"{where}: a stage's figures are {entry!r}, not an object (a damaged file); "
                             f"{_REGENERATE}.")
    rel = _number(entry.get("measured_max_rel"), f"{where}: measured_max_rel", low=0.0)
    absolute = _number(entry.get("measured_max_abs"), f"{where}: measured_max_abs", low=0.0)
    scale = _number(entry.get("min_row_scale", 0.0), f"{where}: min_row_scale", low=0.0)
    stated_rtol = _number(entry.get("rtol"), f"{where}: rtol", low=0.0)
    stated_atol = _number(entry.get("atol"), f"{where}: atol", low=0.0)
    rtol = margin * max(rel, u)
    atol_limit = max(rtol * scale, margin * absolute)
    if abs(stated_rtol - rtol) > 1e-9 * rtol or stated_atol > atol_limit * (1 + 1e-9):
        raise ToleranceError(f"{where}: a stage states rtol {stated_rtol:g}, atol {stated_atol:g}, but its own "
                             f"figures (measured max_rel {rel:g}, max_abs {absolute:g}, margin {margin:g}) give rtol "
                             f"{rtol:g} and atol at most {atol_limit:g}: the file was edited or damaged. "
                             f"{_REGENERATE}.")
    if rtol >= 1:
        raise ToleranceError(f"{where}: a stage's measured noise gives rtol {rtol:g} (>= 100% of the row), which "
                             f"checks nothing: that path is too coarse for this head. Use another path "
                             f"(--profile FILE:float32) or a named profile.")
    floor = " (floor: one rounding)" if rel < u else ""
    return Tol(rtol, stated_atol, f"{path} noise x{margin:g}: measured max_rel {rel:.2g}, max_abs {absolute:.2g}{floor}")


def _number(value, what: str, low: float, high: float = math.inf) -> float:
    """A finite JSON number in [low, high] (never a bool or a string), or the ToleranceError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not low <= value <= high:
        raise ToleranceError(f"{what} is {value!r}: expected a number in [{low:g}, {high:g}] (a damaged or edited "
                             f"file); {_REGENERATE}.")
    return float(value)
