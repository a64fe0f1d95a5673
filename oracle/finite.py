"""A reference holds finite numbers only: NaN or Inf in a stage is refused before the trace is written.

A NaN stage cannot judge a candidate (every comparison with NaN fails, or a careless one passes), and it almost
always comes from the checkpoint: a NaN weight or FP8 block scale. The export names the first stage and token
that hold one, and, only on this failure path, scans the head's stored tensors to name the ones that hold NaN/Inf.
"""

import numpy as np

from oracle.checkpoint import Checkpoint, _widen
from oracle.errors import CheckpointError, InputError

_SCAN_ELEMENTS = 1 << 24  # a head tensor is widened this many elements at a time (64 MB of float32)


def check_finite_reference(ckpt: Checkpoint, inputs, stages: dict[str, np.ndarray], order: list[str],
                           evidence: dict[str, np.ndarray]) -> None:
    """Raise (exit 2) when any stage row holds NaN/Inf (an evidence row NaN), naming the first stage (in `order`)
    and token, and the head tensors holding NaN/Inf (or the input, hidden or embedding rows, that is not finite).
    `inputs`: the TraceInputs the head consumed."""
    found = _first_nonfinite({f"stage {n}": stages[n] for n in order if n in stages}) or \
        _first_nonfinite({f"evidence {n}": v for n, v in evidence.items()}, allow_inf=True)
    if found is None:
        return
    where, token = found
    what = (f"the reference's {where} is NaN/Inf at token {token} (of {inputs.num_tokens}); a reference must be "
            f"finite.")
    bad_hidden = _nonfinite_rows(inputs.hidden)
    if bad_hidden.size:  # (a --hidden file is checked when read: this is the main model's output)
        raise InputError(f"{what} The hidden H the head consumed is NaN/Inf at token(s) "
                         f"{', '.join(map(str, bad_hidden[:8]))}: check the main model's weights in {ckpt.path}, "
                         f"or pass a finite hidden with --hidden.")
    bad_embed = _nonfinite_rows(inputs.embed)
    if bad_embed.size:
        ids = ", ".join(str(int(inputs.token_ids[t])) for t in bad_embed[:8])
        raise CheckpointError(f"{what} The embedding rows of token id(s) {ids} hold NaN/Inf: the checkpoint's "
                              f"embedding table in {ckpt.path} is damaged there. Re-download or re-convert it.")
    tensors = nonfinite_head_tensors(ckpt)
    if tensors:
        raise CheckpointError(f"{what} The checkpoint's head holds NaN/Inf in {', '.join(tensors)} ({ckpt.path}). "
                              f"Re-download or re-convert the checkpoint; a reference is exported from finite "
                              f"weights.")
    raise CheckpointError(f"{what} No head tensor in {ckpt.path} holds NaN/Inf, so the values overflowed float32: "
                          f"check the scale of the hidden (--hidden) and of the weights.")


def _nonfinite_rows(rows: np.ndarray) -> np.ndarray:
    rows = rows.reshape(len(rows), -1)
    return np.flatnonzero(~np.isfinite(rows).all(axis=1))


def _first_nonfinite(arrays: dict[str, np.ndarray], allow_inf: bool = False) -> tuple[str, int] | None:
    """(name, first token) of the first array holding NaN (or Inf, unless `allow_inf`: a routing margin is +Inf
    where no error can flip the choice)."""
    for name, rows in arrays.items():
        if rows.dtype.kind == "f":
            rows = rows.reshape(len(rows), -1)
            if (not np.isnan(rows).any()) if allow_inf else np.isfinite(rows).all():
                continue  # the common case, in one quick pass; rows are located only on failure
            bad = np.flatnonzero(np.isnan(rows).any(axis=1) if allow_inf else ~np.isfinite(rows).all(axis=1))
            if bad.size:
                return name, int(bad[0])
    return None


def nonfinite_head_tensors(ckpt: Checkpoint) -> list[str]:
    """Names of the head's tensors (weights and block scales, as stored, widened exactly) holding NaN or Inf;
    a few at a time so that a stacked-experts tensor is never widened whole."""
    weights = ckpt.read_head(widen=False, digest=False)
    routed = set(weights.layout.experts.tensor_names()) if weights.layout and weights.layout.experts else set()
    bad = []
    for name in sorted(weights.tensors):
        stored, dtype = weights.tensors[name], weights.dtypes[name]
        if stored.ndim == 0:
            stored = stored.reshape(1)
        step = max(1, _SCAN_ELEMENTS // max(1, int(np.prod(stored.shape[1:], dtype=np.int64))))
        # routed experts are mapped views: their blocks are read with pread (a shard cut short: CheckpointError,
        # where touching a page past its new end was a SIGBUS)
        block = ((lambda i: ckpt.stored_rows(name, i, min(i + step, len(stored)))[0]) if name in routed
                 else (lambda i: stored[i:i + step]))
        if any(not np.isfinite(_widen(block(i), dtype)).all() for i in range(0, len(stored), step)):
            bad.append(f"{name} ({dtype})")
    return bad
