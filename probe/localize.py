"""Where a candidate first diverges: the earliest token, and there the first stage in the reference's order.

Stage s at token t depends only on tokens <= t, so the earliest divergent token's first divergent stage is the
causal origin; later tokens inherit it through the KV cache.
"""

from typing import Iterable, Sequence

from oracle.stages import STAGE_NAMES

from probe.compare import DIVERGENT_STATUSES, Cell, StageRows
from probe.evidence import cell_at


def first_divergence(rows: Iterable[StageRows], order: Sequence[str] = STAGE_NAMES) -> Cell | None:
    """The divergent row with the smallest (token, stage index in `order`), as a Cell; None when nothing diverged."""
    firsts = []
    for r in rows:
        tokens = r.tokens[r.has_status(DIVERGENT_STATUSES)]
        if tokens.size:
            firsts.append((int(tokens[0]), list(order).index(r.stage), r))
    if not firsts:
        return None
    token, _, r = min(firsts, key=lambda f: f[:2])
    return cell_at(r, token)


def first_divergence_per_token(rows: Iterable[StageRows], order: Sequence[str] = STAGE_NAMES) -> dict[int, str]:
    """For each token with a divergence, its first divergent stage in `order`."""
    first: dict[int, str] = {}
    for r in sorted(rows, key=lambda r: list(order).index(r.stage)):
        for token in r.tokens[r.has_status(DIVERGENT_STATUSES)].tolist():
            first.setdefault(token, r.stage)
    return dict(sorted(first.items()))
