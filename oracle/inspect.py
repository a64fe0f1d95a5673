"""`mtp-oracle inspect`: what a trace holds — schema, provenance, inputs and per-stage statistics."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oracle.stages import STAGE_BY_NAME
from oracle.trace import read_trace, rows_per_chunk
from oracle.text import printable


@dataclass(frozen=True)
class StageStats:
    name: str
    shape: tuple[int, ...]
    dtype: str
    mean: float
    std: float
    absmax: float
    nonfinite: int


def stage_stats(reader, name: str) -> StageStats:
    """Mean, std, absmax and non-finite count of one stage, read in row chunks (memory bounded)."""
    shape = reader.stage_shape(name)
    total = total_sq = 0.0
    absmax, nonfinite, count = 0.0, 0, 0
    step = rows_per_chunk(max(shape[1], 1), shape[0]) if len(shape) == 2 else shape[0]  # (a [T, 0] stage: no values)
    for start in range(0, shape[0], max(step, 1)):
        rows = np.asarray(reader.stage_rows(name, start, start + step), dtype=np.float64)
        finite = rows[np.isfinite(rows)]
        nonfinite += rows.size - finite.size
        total, total_sq, count = total + finite.sum(), total_sq + (finite**2).sum(), count + finite.size
        absmax = max(absmax, float(np.abs(finite).max(initial=0.0)))
    mean = total / count if count else float("nan")
    std = float(np.sqrt(max(total_sq / count - mean**2, 0.0))) if count else float("nan")
    return StageStats(name, shape, str(reader.stage_dtype(name)), mean, std, absmax, nonfinite)


def render_inspection(path: Path) -> str:
    """The inspection report; what came from the file shows with its control characters escaped."""
    return printable(_inspection(path), keep_lines=True)


def _inspection(path: Path) -> str:
    with read_trace(path) as reader:
        attrs = reader.attrs
        lines = [f"{path}: {attrs['schema']}, family {attrs.get('family', '?')}, "
                 f"T={reader.num_tokens} tokens, D={reader.hidden_size}"]
        for key in ("producer", "checkpoint_digest", "inputs_digest"):
            if key in attrs:
                lines.append(f"  {key:<18} {attrs[key]}")
        if "experts" in attrs:
            lines.append(f"  {'experts':<18} {_experts(attrs['experts'], reader.dims.num_experts)}")
        for key in ("versions", "config", "provenance"):
            if key in attrs:
                lines.append(f"  {key:<18} {json.dumps(attrs[key], sort_keys=True)}")
        if reader.has_inputs:
            inputs = reader.verified_inputs()  # an edited reference is refused, as the probe refuses it
            lines.append(f"  token_ids          {_preview(inputs.token_ids)}")
            lines.append(f"  positions          {_preview(inputs.positions)}")
        stage_list = reader.stage_list  # the trace's own stages, with the doc/kind/shape it stores
        lines += stage_meanings(stage_list)
        w = max(7, *(len(n) + 2 for n in stage_list.names))
        lines.append(f"  {'stage':<{w}}{'width':>7}  {'dtype':<8}{'mean':>11}{'std':>11}{'absmax':>11}{'nonfinite':>10}")
        for name in stage_list.names:
            s = stage_stats(reader, name)
            lines.append(f"  {name:<{w}}{s.shape[-1]:>7}  {s.dtype:<8}{s.mean:>11.4g}{s.std:>11.4g}"
                         f"{s.absmax:>11.4g}{s.nonfinite:>10}")
        # A trace declares its own list; one written before families (no `family`) has the default one.
        expected = stage_list.names if "family" in attrs else tuple(STAGE_BY_NAME)
        missing = [n for n in expected if n not in stage_list.names]
        lines.append(f"  {len(stage_list.names)}/{len(expected)} stages"
                     + (f", not captured: {', '.join(missing)}" if missing else ""))
    return "\n".join(lines)


def stage_meanings(stage_list) -> list[str]:
    """One line per stage: name, shape, and its one-line doc (`index_set` stages are compared as sets)."""
    w = max(len(n) for n in stage_list.names) if stage_list.names else 5
    lines = ["  stages (in order; the first divergent stage is the first in this order):"]
    for stage in stage_list:
        kind = "  [compared as a set]" if stage.kind != "rows" else ""
        lines.append(f"    {stage.name:<{w}}  {stage.shape:<7} {stage.doc}{kind}")
    return lines


_EXPERT_IDS = 8  # used expert ids shown


def _experts(experts: dict, num_experts: int) -> str:
    """The routed experts a MoE trace used (its `experts` attribute, oracle/export.py): layout, how many of the
    head's, the first ids, their digest; as stored (JSON) when it is not in that form."""
    used, digest = experts.get("used"), experts.get("digest")
    if not isinstance(used, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in used):
        return json.dumps(experts, sort_keys=True)
    of = f" of {num_experts}" if num_experts else ""
    first = ",".join(map(str, used[:_EXPERT_IDS])) + (",…" if len(used) > _EXPERT_IDS else "")
    text = f"layout {experts.get('layout', '?')}, {len(used)}{of} used ({first}), digest {digest}"
    if "group_limited_tokens" in experts:
        text += f", group_limited_tokens {experts['group_limited_tokens']}"
    return text


def _preview(arr: np.ndarray, limit: int = 12) -> str:
    head = ",".join(str(int(v)) for v in arr[:limit])
    return head + (f",… ({len(arr)} in all)" if len(arr) > limit else "")
