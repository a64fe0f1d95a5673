"""What went wrong loading one tensor: the engine's copy `a` against the checkpoint's `e`, classified.

Tried in this order (the first that fits names the fault): ok (bit-identical, a few float32 ulps, or exactly the
checkpoint rounded to bfloat16/float16: an error merely of rounding SIZE is not ok, since a x1.003 moves stages
past tolerance), zeros, init_like (a norm left at its initial value: all 0 for a (1+w) norm, all 1 for a w·x̂
one; a zeroed bias or a zeroed w·x̂ norm is `zeros`), constant, transposed (a square matrix stored transposed),
scaled (one constant factor: a forgotten dequant scale, or any factor a bf16 dump's rounding cannot make, e.g.
x1.04 exactly), different (rounding-sized but not a rounding: the audit says it cannot judge the effect),
permuted_rows (rows, or the input columns, of the checkpoint in another order: a true permutation, every row used
once; per-expert tensors say whether whole experts moved or rows within each expert, e.g. gate/up halves), zeros
or different (some rows or columns all 0, or wholly unlike the checkpoint's, where the rest match: a partial
load; no quantization does that), quantized (highly correlated, error of quantization size spread over the
tensor), init_like (a linear uncorrelated with the checkpoint whose spread is that of a fresh initialisation),
different (a norm that is exactly the checkpoint's ± 1 says so: the (1+w) convention mixed up).
A tensor whose shape is the checkpoint's transposed is classified after transposing back: `transposed` when it then
matches (ok, scaled or quantized), otherwise the fault found, noted as stored transposed. Torch-free.
"""

from dataclasses import dataclass

import numpy as np

# OK_REL: bfloat16 rounding size (the closeness of a row or a transposed copy); `ok` itself is stricter: the exact
# checkpoint rounded to bf16/f16, or within a few float32 ulps (_rounding_of)
OK_REL = 2.0 ** -8
QUANTIZED_CORR, QUANTIZED_RMS = 0.98, 0.25  # int4 per-group is ~8-10% rms error; 25% leaves room, 0.98 keeps noise out
UNCORRELATED = 0.1
SCALE_MIN = 0.05  # |log factor| above log(1.05): a real dequant scale is far from 1; quantization bias is not
EXACT_SCALE_MIN = 2.0 ** -9  # |factor - 1| a bf16 dump's rounding cannot produce on average (half its ulp)
F32_ULPS = 4


@dataclass(frozen=True)
class Finding:
    status: str
    max_rel: float | None  # max|a - e| / max|e| (`transposed`: after transposing back); None when not comparable
    note: str


@dataclass(frozen=True)
class TensorFacts:
    """What the classification may know about the tensor beyond its values."""

    name: str
    init_stds: dict[str, float]  # label -> std of a fresh initialisation of this tensor
    halves_perm: np.ndarray | None = None  # the q/gate-halves row order of a q_proj (checkpoint row per dump row)
    norm: str | None = None  # an RMSNorm's weight: "1+w" (scales by 1 + w: fresh w = 0) or "w" (fresh w = 1)


def classify(a: np.ndarray, e: np.ndarray, facts: TensorFacts) -> Finding:
    """Classify the engine's tensor `a` against the checkpoint's `e` (both float; shapes equal or transposed)."""
    if a.shape != e.shape:
        return _transposed(a, e, facts)
    a, e = np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64)
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        return Finding("different", None, f"{bad} NaN/Inf element{'s' if bad > 1 else ''}")
    err = np.abs(a - e)
    scale = float(np.abs(e).max()) or 1.0
    max_rel = float(err.max()) / scale
    rounded = _rounding_of(a, e, scale)
    if rounded:
        return Finding("ok", max_rel, rounded)
    flat = a.reshape(-1)
    if not flat.any():
        if facts.norm == "1+w":
            return Finding("init_like", max_rel, "all 0: a (1+w) RMSNorm's initial value (never loaded?)")
        return Finding("zeros", max_rel, "every element is 0" + (" (a w·x̂ RMSNorm at 0 zeroes its output)"
                                                                 if facts.norm == "w" else ""))
    if (flat == flat[0]).all():
        if facts.norm and flat[0] == 1.0:
            return Finding("init_like", max_rel, "all 1: a w·x̂ RMSNorm's initial value (never loaded?"
                           + (" this head's norms are (1+w), whose initial w is 0)" if facts.norm == "1+w" else ")"))
        return Finding("constant", max_rel, f"every element is {flat[0]:.6g}")
    return _by_values(a, e, facts, max_rel)


def _rounding_of(a: np.ndarray, e: np.ndarray, scale: float) -> str:
    """How `a` is the checkpoint's `e` held at some precision, or '' when it is not: bit-identical; within a few
    float32 ulps (another dequantization order); or EXACTLY `e` rounded to bfloat16 (to nearest even, or truncated)
    or float16, every element. An error merely of rounding size is not rounding: a x1.003 on a bf16 tensor, or a
    bias of an ulp, moves stages past tolerance, so it is never `ok` (the classification below names it)."""
    if np.array_equal(a, e):
        return "bit-identical"
    e32 = e.astype(np.float32)
    if (np.abs(a - e) <= F32_ULPS * np.spacing(np.abs(e32)).astype(np.float64) + 1e-30 * scale).all():
        return f"within float32 rounding (at most {F32_ULPS} ulps)"
    bits = e32.view(np.uint32).astype(np.uint64)
    nearest = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    truncated = (bits & 0xFFFF0000).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        half = e32.astype(np.float16).astype(np.float64)
    for rounded, how in ((nearest, "bfloat16 (to nearest even)"), (truncated, "bfloat16 (truncated)"),
                         (half, "float16")):
        if np.array_equal(a, np.asarray(rounded, dtype=np.float64)):
            return f"the checkpoint rounded to {how}"
    return ""


def _by_values(a: np.ndarray, e: np.ndarray, facts: TensorFacts, max_rel: float) -> Finding:
    if a.ndim == 2 and a.shape[0] == a.shape[1] > 1 and _close(a.T, e, float(np.abs(e).max()) or 1.0):
        back = float(np.abs(a.T.astype(np.float64) - e).max()) / (float(np.abs(e).max()) or 1.0)
        return Finding("transposed", back, f"a square {list(a.shape)} matrix stored transposed (rows are the "
                                           f"checkpoint's columns; as stored max_rel {max_rel:.3g})")
    ea, ee = float(np.dot(a.ravel(), a.ravel())), float(np.dot(e.ravel(), e.ravel()))
    dot = float(np.dot(a.ravel(), e.ravel()))
    corr = dot / np.sqrt(ea * ee) if ea and ee else 0.0
    factor = dot / ee if ee else 0.0
    exact = bool(factor) and _scaled_exactly(a, e, factor)  # a factor, then (at most) the dump's bf16 rounding
    if factor and (exact and abs(factor - 1) > EXACT_SCALE_MIN
                   or abs(np.log(abs(factor))) > SCALE_MIN and abs(corr) > QUANTIZED_CORR):
        residual = np.linalg.norm(a - factor * e) / (abs(factor) * np.sqrt(ee))
        return Finding("scaled", max_rel, f"the checkpoint times {factor:.6g} (a forgotten dequant scale?)"
                       + ("" if exact else f"; {residual:.1%} rms error beyond the factor"))
    if _close(a, e, float(np.abs(e).max()) or 1.0):  # rounding-sized, but not a rounding of the checkpoint
        return Finding("different", max_rel, f"off by at most {max_rel:.2g} of the tensor's max (bfloat16 rounding "
                                             f"size), but not the checkpoint rounded to bfloat16 or float16, nor a "
                                             f"constant factor: the load audit cannot judge whether an error this "
                                             f"small moves a stage past tolerance; run the head on a reference "
                                             f"(mtp-probe run) to see its effect")
    permuted = _permutation_note(a, e, facts)
    if permuted:
        return Finding("permuted_rows", max_rel, permuted)
    partial = _partial_rows(a, e, max_rel) or (_partial_rows(a.T, e.T, max_rel, "columns") if a.ndim == 2 else None)
    if partial:
        return partial
    rms = float(np.linalg.norm(a - e) / np.sqrt(ee)) if ee else float("inf")
    if corr > QUANTIZED_CORR and rms < QUANTIZED_RMS:
        return Finding("quantized", max_rel, f"{rms:.2%} rms error, correlation {corr:.4f}: quantization-sized "
                                             f"(int8 ~0.5%, fp8 ~2-3%, int4 ~8-10%)")
    init = _init_like(a, corr, facts)
    if init:
        return Finding("init_like", max_rel, init)
    scale = float(np.abs(e).max()) or 1.0
    for offset, how, norm in ((1.0, "+ 1: the (1+w) of a (1+w) RMSNorm folded into its stored w", "1+w"),
                              (-1.0, "- 1: a plain norm's weight read as a (1+w) norm's w", "w")):
        if a.ndim == 1 and facts.norm in (norm, None) and _close(a - offset, e, scale + 1.0):
            return Finding("different", max_rel, f"exactly the checkpoint's {how}")
    return Finding("different", max_rel, f"correlation {corr:+.3f} with the checkpoint, {rms:.1%} rms error")


def _partial_rows(a: np.ndarray, e: np.ndarray, max_rel: float, what: str = "rows") -> Finding | None:
    """Rows (`what`: "columns" for a matrix's transpose) that are all 0, or wholly unlike the checkpoint's, while the
    others match: a partial load (a shard or a slice never copied), not quantization, whose error is spread over
    every row. How many rows are wrong does not matter (half a matrix zeroed had been `different`), only that the
    rest match; a wrong row with only a few wrong elements says so (a flipped element is not a row "wholly" unlike)."""
    if a.ndim < 2:
        return None
    rows_a, rows_e = a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1])
    norm_e = np.linalg.norm(rows_e, axis=1)
    rel = np.linalg.norm(rows_a - rows_e, axis=1) / np.where(norm_e == 0, 1.0, norm_e)
    zero = ~rows_a.any(axis=1) & rows_e.any(axis=1)
    wrong = rel > 0.5  # no quantization moves a whole row by half its norm while the others stay close
    if not wrong.any() or wrong.all() or np.median(rel[~wrong]) > QUANTIZED_RMS:
        return None
    n, bad = len(rel), int(np.count_nonzero(wrong))
    first = ", ".join(map(str, np.flatnonzero(wrong)[:5])) + (" …" if bad > 5 else "")
    if zero[wrong].all():
        return Finding("zeros", max_rel, f"{bad} of {n} {what} are all 0 ({what} {first}): a partially loaded "
                                         f"tensor?")
    scale = float(np.abs(rows_e).max()) or 1.0
    off = ~(np.abs(rows_a[wrong] - rows_e[wrong]) <= OK_REL * np.abs(rows_e[wrong]) + 1e-7 * scale)
    if off.sum(axis=1).max() <= max(1, rows_a.shape[1] // 10):
        return Finding("different", max_rel, f"{int(off.sum())} element(s) in {bad} of {n} {what} ({what} {first}) "
                                             f"differ from the checkpoint's while the rest match")
    return Finding("different", max_rel, f"{bad} of {n} {what} differ wholly from the checkpoint's ({what} {first}) "
                                         f"while the rest match: a partial or misplaced load?")


def _scaled_exactly(a: np.ndarray, e: np.ndarray, factor: float) -> bool:
    """Whether a = factor·e to within the rounding of a bfloat16 dump (half an ulp of a: at most 2^-8 |a|, with
    room for the factor's own error, measured from the rounded values)."""
    tiny = 1e-7 * (float(np.abs(a).max()) or 1.0)
    return bool((np.abs(a - factor * e) <= 1.1 * OK_REL * np.abs(a) + tiny).all())


def _close(a: np.ndarray, e: np.ndarray, scale: float) -> bool:
    return bool((np.abs(a - e) <= OK_REL * np.abs(e) + 1e-7 * scale).all())


def _transposed(a: np.ndarray, e: np.ndarray, facts: TensorFacts) -> Finding:
    back = np.swapaxes(a, -1, -2)  # (…, in, out) -> (…, out, in)
    inner = classify(back, e, facts)
    if inner.status in ("ok", "scaled", "quantized"):
        extra = "" if inner.status == "ok" else f"; transposed back it is {inner.status}: {inner.note}"
        return Finding("transposed", inner.max_rel, f"stored as {list(a.shape)}, the checkpoint's "
                                                    f"{list(e.shape)} transposed{extra}")
    return Finding(inner.status, inner.max_rel, f"{inner.note} (and stored transposed, {list(a.shape)})")


def _permutation_note(a: np.ndarray, e: np.ndarray, facts: TensorFacts) -> str:
    """A note when `a`'s rows (or, 2-D, columns) are the checkpoint's in another order; '' otherwise."""
    if a.ndim < 2:
        return ""
    rows = _row_permutation(a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1]))
    if rows is not None:
        moved = int(np.count_nonzero(rows != np.arange(len(rows))))
        note = f"{moved} of {len(rows)} rows are checkpoint rows in another order"
        if facts.halves_perm is not None and np.array_equal(rows[:len(facts.halves_perm)], facts.halves_perm):
            note += ("; exactly [all q | all gate] instead of the per-head [q_h | gate_h] interleave "
                     "(q/gate halves)")
        elif a.ndim == 3:
            note += _experts_note(rows.reshape(a.shape[0], a.shape[1]), a.shape[1])
        elif _halves_swapped(rows):
            note += "; exactly its two row halves swapped (e.g. a fused gate_up read as [up | gate])"
        return note
    if a.ndim == 2:
        cols = _row_permutation(a.T, e.T)
        if cols is not None:
            half = a.shape[1] // 2
            swapped = a.shape[1] % 2 == 0 and np.array_equal(cols, np.r_[half:2 * half, 0:half])
            return (f"columns (the input dimension) in another order, rows intact"
                    + ("; exactly its two halves swapped (e.g. fc's concat [e, h] read as [h, e])" if swapped else ""))
    return ""


def _halves_swapped(order: np.ndarray) -> bool:
    half = len(order) // 2
    return len(order) % 2 == 0 and np.array_equal(order, np.r_[half:2 * half, 0:half])


def _experts_note(perm: np.ndarray, rows: int) -> str:
    """What a row permutation of a per-expert [E, R, C] tensor moved (`perm`: [E, R] flat checkpoint row of each
    dump row): whole experts (each dump expert one checkpoint expert, rows in order), rows within each expert
    (the same order in every moved expert names it: its two halves swapped is a w13/gate_up read as [up, gate]),
    or rows across experts."""
    source, row = perm // rows, perm % rows
    experts = np.arange(len(perm))
    if (source == source[:, :1]).all() and (row == np.arange(rows)).all():
        moved = int(np.count_nonzero(source[:, 0] != experts))
        return f"; whole experts swapped (expert order: {moved} of {len(perm)} experts hold another's rows)"
    if (source == experts[:, None]).all():
        changed = [e for e in experts if not np.array_equal(row[e], np.arange(rows))]
        same = all(np.array_equal(row[e], row[changed[0]]) for e in changed)
        where = f"in {len(changed)} of {len(perm)} experts" if len(changed) < len(perm) else "in every expert"
        if same and _halves_swapped(row[changed[0]]):
            return (f"; rows permuted within each expert, not across: the two halves of each expert's rows swapped "
                    f"{where} (a fused gate_up / w13 read as [up | gate])")
        return (f"; rows permuted within each expert, not across ({where}"
                + (", the same order in each)" if same else ")"))
    return "; rows moved across experts"


def _row_permutation(a: np.ndarray, e: np.ndarray) -> np.ndarray | None:
    """perm with a[i] ≈ e[perm[i]] for every row (not the identity), found by matching row fingerprints; None if
    the rows are not a permutation of the checkpoint's."""
    n = a.shape[0]
    if n < 2:
        return None
    r = np.random.default_rng(0).standard_normal(a.shape[1])
    pa, pe = a @ r, e @ r  # (rows,) fingerprints: equal rows, equal fingerprints (to rounding)
    order_e = np.argsort(pe, kind="stable")
    perm = np.empty(n, dtype=np.int64)
    perm[np.argsort(pa, kind="stable")] = order_e
    scale = float(np.abs(e).max()) or 1.0
    for i in np.flatnonzero(~_rows_close(a, e[perm], scale)):  # near-equal fingerprints may pair wrongly
        at = np.searchsorted(pe[order_e], pa[i])
        window = order_e[max(0, at - 8):at + 8]
        hits = window[_rows_close(np.broadcast_to(a[i], (len(window), a.shape[1])), e[window], scale)]
        if not len(hits):
            return None
        perm[i] = hits[0]
    if len(np.unique(perm)) != n:  # a checkpoint row used twice (a duplicated row) is no permutation
        return None
    return None if np.array_equal(perm, np.arange(n)) else perm


def _rows_close(a: np.ndarray, e: np.ndarray, scale: float) -> np.ndarray:
    return (np.abs(a - e) <= OK_REL * np.abs(e) + 1e-7 * scale).all(axis=1)


def _init_like(a: np.ndarray, corr: float, facts: TensorFacts) -> str:
    if abs(corr) > UNCORRELATED or a.ndim < 2:
        return ""
    std, mean = float(a.std()), float(a.mean())
    if abs(mean) > 0.1 * std:
        return ""
    for label, init in facts.init_stds.items():
        if 0.7 < std / init < 1.4:
            return (f"uncorrelated with the checkpoint (correlation {corr:+.3f}), std {std:.3g} ≈ {label} "
                    f"({init:.3g}): a fresh initialisation, never loaded?")
    return ""


def halves_permutation(num_heads: int, head_dim: int) -> np.ndarray:
    """Checkpoint row of each row of a q_proj laid out [all q | all gate] (the checkpoint is per head
    [q_h | gate_h]): the permutation an engine that splits q_proj in halves applies."""
    head, dim = np.divmod(np.arange(num_heads * head_dim), head_dim)
    q = head * 2 * head_dim + dim
    return np.concatenate([q, q + head_dim])


def init_stds(shape: tuple[int, ...], initializer_range: float) -> dict[str, float]:
    """Standard deviations of the usual fresh initialisations of a linear weight [.., out, in]."""
    fan_in = shape[-1]
    return {f"normal(0, initializer_range={initializer_range:g})": initializer_range,
            "nn.Linear's default kaiming_uniform": 1.0 / np.sqrt(3.0 * fan_in)}
