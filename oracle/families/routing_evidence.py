"""Per-expert flip distances of a top-k router: evidence about the routing, recorded as /evidence/topk_flip.

For each token and expert: the smallest error in the router's logits (in the same units as `topk_margin`, which
is their minimum) that could move that expert into or out of the chosen set. The probe excuses a `topk_ids`
difference at a near-tie token as rounding (`tie`) only when every expert the two sets disagree on has a flip
distance within the router_logits tolerance, so an arbitrary wrong set at a near-tie token stays a divergence.

A distance may be smaller than the exact one (that only excuses more: still a near-tie row, never evidence), never
larger than a flip that rounding could cause. torch in, torch out; the families call these on their router's own
selection scores (oracle/families/*.py)."""

import torch


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
