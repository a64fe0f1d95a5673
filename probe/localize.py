"""Where a candidate first diverges: the earliest token, and there the first stage in STAGES order.

Stage s at token t depends only on tokens <= t, so the earliest divergent token's first divergent stage is the
causal origin; later tokens inherit it through the KV cache.
"""

from typing import Iterable

from oracle.stages import stage_index

from probe.compare import DIVERGENT_STATUSES, Cell


def first_divergence(cells: Iterable[Cell]) -> Cell | None:
    """The divergent cell with the smallest (token, stage index), or None when nothing diverged."""
    divergent = (c for c in cells if c.diff.status in DIVERGENT_STATUSES)
    return min(divergent, key=lambda c: (c.token, stage_index(c.stage)), default=None)


def first_divergence_per_token(cells: Iterable[Cell]) -> dict[int, str]:
    """For each token with a divergence, its first divergent stage in STAGES order."""
    first: dict[int, str] = {}
    for cell in cells:
        if cell.diff.status in DIVERGENT_STATUSES:
            known = first.get(cell.token)
            if known is None or stage_index(cell.stage) < stage_index(known):
                first[cell.token] = cell.stage
    return dict(sorted(first.items()))
