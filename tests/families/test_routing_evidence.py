"""/evidence/topk_flip: per-expert flip distances whose minimum is the recorded topk_margin (the per-token bound
the probe already trusts), largest for the experts far from the selection boundary."""

from types import SimpleNamespace

import torch

from oracle.families.mtp_layer import routing_evidence
from oracle.families.torch_parts import selection_margin
from oracle.families.routing_evidence import grouped_flip_distances, topk_flip_distances


def grouped_choice(choice: torch.Tensor, groups: int, keep: int, k: int) -> torch.Tensor:
    """noaux_tc's selection, written out: top `keep` groups by their top-2 sum, then top-k inside them."""
    n, e = choice.shape
    group_scores = choice.view(n, groups, -1).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros(n, groups, dtype=torch.bool).scatter_(1, group_scores.topk(keep, -1).indices, True)
    masked = choice.masked_fill(~kept.repeat_interleave(e // groups, 1), float("-inf"))
    return masked.topk(k, -1).indices


def test_plain_top_k_distances_bound_the_margin_and_grow_away_from_the_boundary():
    torch.manual_seed(0)
    logits = torch.randn(64, 32)
    ids = logits.topk(6, -1).indices
    flips = topk_flip_distances(logits, ids)
    torch.testing.assert_close(flips.min(-1).values, selection_margin(logits, 6)[:, 0], rtol=0, atol=0)
    order = logits.argsort(-1, descending=True)
    rows = torch.arange(64)
    boundary = flips[rows, order[:, 5]], flips[rows, order[:, 6]]
    assert (boundary[0] == boundary[1]).all()  # the k-th and the (k+1)-th share the margin
    assert (flips[rows, order[:, 0]] > boundary[0]).all() and (flips[rows, order[:, -1]] > boundary[0]).all()


def test_grouped_distances_bound_the_recorded_margin():
    torch.manual_seed(1)
    groups, keep, k, e = 4, 2, 4, 32
    logits = torch.randn(64, e)
    bias = 0.1 * torch.randn(e)
    gate = SimpleNamespace(num_group=groups, topk_group=keep, top_k=k, e_score_correction_bias=bias)
    ids = grouped_choice(logits.sigmoid() + bias, groups, keep, k)
    margin, _, flips = routing_evidence(gate, logits, ids)
    torch.testing.assert_close(flips.min(-1).values, margin[:, 0], rtol=0, atol=0)
    assert (flips >= 0).all()
    # an expert of a dropped group can only enter with its group: at least the group gap away
    assert torch.equal(flips, grouped_flip_distances(logits.sigmoid() + bias, ids, groups, keep))


def test_a_wrong_selection_is_not_mistaken_for_the_recorded_one():
    """Twin: distances computed for another choice than the router's (e.g. the top-k of the raw logits, ignoring the
    bias) are not the recorded ones, so the check above can fail."""
    torch.manual_seed(1)
    logits, bias = torch.randn(64, 32), 0.5 * torch.randn(32)
    right = grouped_choice(logits.sigmoid() + bias, 4, 2, 4)
    wrong = grouped_choice(logits.sigmoid(), 4, 2, 4)
    assert not torch.equal(grouped_flip_distances(logits.sigmoid() + bias, right, 4, 2),
                           grouped_flip_distances(logits.sigmoid() + bias, wrong, 4, 2))
