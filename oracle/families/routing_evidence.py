"""Per-expert flip distances of a top-k router: evidence about the routing, recorded as /evidence/topk_flip.

For each token and expert: the smallest error in the router's logits (in the same units as `topk_margin`, which
is their minimum) that could move that expert into or out of the chosen set. The probe excuses a `topk_ids`
difference at a near-tie token as rounding (`tie`) only when every expert the two sets disagree on has a flip
distance within the router_logits tolerance, so an arbitrary wrong set at a near-tie token stays a divergence.

A distance may be smaller than the exact one (that only excuses more: still a near-tie row, never evidence), never
larger than a flip that rounding could cause. torch in, torch out; the families call these on their router's own
selection scores (oracle/families/*.py)."""

import numpy as np
import torch

# The probe's default float32 tolerance (probe/tolerance.py DEFAULT) for router_logits, restated for the export's
# warning (the oracle never imports the probe); the probe judges near-ties with the tolerance of its own diff.
WARN_RTOL, WARN_ATOL = 1e-4, 1e-5


def near_tie_tokens(router_logits: np.ndarray, margin: np.ndarray) -> np.ndarray:
    """Tokens whose top-k selection margin is within twice the default router_logits tolerance (the probe's
    near-tie rule, probe/diff.py _Routing): a candidate may choose other experts there by rounding alone, and a diff
    against this reference is then at best inconclusive at those tokens."""
    logits = np.asarray(router_logits, dtype=np.float64)
    limit = 2 * np.maximum(WARN_ATOL, WARN_RTOL * np.abs(logits).max(axis=1))
    return np.flatnonzero(np.asarray(margin, dtype=np.float64).reshape(len(logits), -1)[:, 0] < limit)


def near_tie_warning(tokens: np.ndarray, num_tokens: int) -> str:
    shown = ", ".join(map(str, tokens[:12])) + (f" and {len(tokens) - 12} more" if len(tokens) > 12 else "")
    return (f"warning: the router's own top-k selection is a near-tie at {len(tokens)} of {num_tokens} token(s) "
            f"({shown}): a candidate within rounding may choose other experts there, and a diff is then at best "
            f"inconclusive at those tokens. Export with other tokens or hidden rows to avoid them.")


def topk_flip_distances(choice: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A plain top-k over `choice` (N, E) choosing `ids` (N, k): a chosen expert leaves when the best unchosen
    score passes it (distance s_i - s_(k+1)); an unchosen one enters when it passes the k-th chosen score
    (s_(k) - s_j). inf everywhere when every expert is chosen."""
    choice = choice.float()
    n, e = choice.shape
    k = ids.shape[-1]
    if k >= e:
        return torch.full((n, e), float("inf"))
    chosen = torch.zeros(n, e, dtype=torch.bool).scatter_(1, ids, True)
    kth = choice.masked_fill(~chosen, float("inf")).min(dim=-1, keepdim=True).values
    best_unchosen = choice.masked_fill(chosen, float("-inf")).max(dim=-1, keepdim=True).values
    return torch.where(chosen, choice - best_unchosen, kth - choice)


def grouped_flip_distances(choice: torch.Tensor, ids: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """A group-limited top-k (DeepSeek-V3's noaux_tc): groups ranked by the sum of their top-2 scores, the top
    `keep` groups kept, then the top-k of the kept experts (`ids`). In the units of that router's `topk_margin`
    (oracle/families/mtp_layer.py routing_evidence: a logit error d moves a group score by <= d/2 and the gap
    between two experts by <= d/2, hence 2x the in-group gap):
      chosen i:            min(2 (s_i - best unchosen kept score), G(group of i) - G(best dropped group))
      unchosen, kept j:    2 (s_(k) - s_j), s_(k) the k-th chosen score
      unchosen, dropped j: G(weakest kept group) - G(group of j) (its group must enter first; a lower bound)"""
    choice = choice.float()
    n, e = choice.shape
    per_group = e // groups
    group_scores = choice.view(n, groups, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)  # (N, G)
    kept_groups = torch.zeros(n, groups, dtype=torch.bool).scatter_(1, torch.topk(group_scores, keep, -1).indices,
                                                                       True)
    inf = float("inf")
    weakest_kept = group_scores.masked_fill(~kept_groups, inf).min(dim=-1, keepdim=True).values
    best_dropped = group_scores.masked_fill(kept_groups, -inf).max(dim=-1, keepdim=True).values  # -inf: none
    kept = kept_groups.repeat_interleave(per_group, dim=1)
    expert_group_score = group_scores.repeat_interleave(per_group, dim=1)
    inside = torch.where(kept, choice, torch.full_like(choice, -inf))
    inner = topk_flip_distances(inside, ids)  # among the kept experts; dropped ones come out +inf
    chosen = torch.zeros(n, e, dtype=torch.bool).scatter_(1, ids, True)
    leave_group = expert_group_score - best_dropped  # inf when no group is dropped
    enter_group = weakest_kept - expert_group_score
    return torch.where(chosen, torch.minimum(2 * inner, leave_group), torch.where(kept, 2 * inner, enter_group))
