"""Measuring, at export, which attention rows could witness q, k, q_norm, k_norm and RoPE.

Attention's output at step t is Σ_j p_j v_j over the visible keys j ≤ t. Whatever q and k compute only moves the
weights p. So if the output with *uniform* weights over the visible keys equals the real output (within the
tolerance), a candidate with a broken q/k path can produce the same row: that row is no evidence of q/k. That is
always so at t = 0 (one key, softmax ≡ 1), and at every t when the value rows coincide (repeated token and hidden).

`uniform_attention` is an attention function with the signature of transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`): the official attention module computes q, k, v, gate and o_proj exactly as in the real
pass, and only the softmax(q·k) weights are replaced by uniform ones over the keys the mask lets through. The
oracle records the resulting rows as `/evidence/attn_uniform`; the probe counts an `attn` row as q/k evidence only
where that row would FAIL the tolerance rule against the real one (probe/evidence.py).

Uniform weights need no scores: the row is the mean of the visible value rows (with a sink: their sum over n + 1).
`uniform_mean_attention`, the function the export runs, takes those means from prefix sums (float64) of each KV
head's value rows, one vectorised pass; `uniform_attention` (softmax over zeros plus the mask, then p·V) is its
specification and the fallback for masks that are not a band of keys. `reused_projections` spares the second run
of the attention module's projections: every linear inside it hands back the output it computed in the real pass
when the uniform pass gives it the very same input (compared, not assumed); only the output projection, whose
input differs, computes again. So the official module still runs the whole uniform pass, for every family alike.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

UNIFORM = "mtp_uniform_weights"


def uniform_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None, **kwargs):
    """Attention with uniform weights over the visible keys: (B, H, T, d) q/k/v -> ((B, T, H, d), weights).

    With attention sinks (`s_aux`, one logit per head that joins the softmax and is dropped: DeepSeek-V4,
    gpt-oss), the sink is one more slot of the softmax at the same logit as every visible key: each of n visible
    keys gets 1/(n+1). At t=0 that is 1/2, where the real weight is sigmoid(q·k·scale - sink), so a t=0 row with
    sinks does depend on q and k (their score against the sink), unlike a sink-free softmax (≡ 1)."""
    value = repeat_kv(value, query.shape[1] // value.shape[1])  # GQA: each query head reads its kv head
    slots = key.shape[2] + (s_aux is not None)  # the sink: one more slot, dropped after the softmax
    scores = torch.zeros(query.shape[0], query.shape[1], query.shape[2], slots, dtype=query.dtype)
    if attention_mask is not None:  # additive: 0 visible, finfo.min blocked
        scores[..., : key.shape[2]] = scores[..., : key.shape[2]] + attention_mask[:, :, :, : key.shape[2]]
    weights = torch.softmax(scores, dim=-1)[..., : key.shape[2]]
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def uniform_mean_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None,
                           **kwargs):
    """`uniform_attention`'s rows without scores: per query, the visible value rows' sum (a difference of float64
    prefix sums over each KV head) over the count of visible keys, plus one with a sink. The visible keys come from
    the additive mask (0 visible, finfo.min blocked); a mask that is not one band of keys per query, or holds other
    values, goes to `uniform_attention`."""
    band = _visible_band(attention_mask, query.shape[2], key.shape[2])
    if band is None:
        return uniform_attention(module, query, key, value, attention_mask, scaling, dropout, s_aux, **kwargs)
    first, count = band  # (Tq,) each: the first visible key and how many follow it
    prefix = torch.nn.functional.pad(torch.cumsum(value.to(torch.float64), dim=2), (0, 0, 1, 0))  # (B, Hkv, Tk+1, d)
    sums = prefix[:, :, first + count] - prefix[:, :, first]  # (B, Hkv, Tq, d)
    means = (sums / (count + (s_aux is not None)).to(torch.float64)[:, None]).to(query.dtype)
    means = means.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # GQA as repeat_kv: kv head i -> i*n..
    return means.transpose(1, 2).contiguous(), None


def _visible_band(attention_mask, q_len: int, k_len: int):
    """(first, count) of each query's visible keys when they form one non-empty band [first, first + count) and the
    mask is the same for every batch row and head; None otherwise (or for a mask of other values)."""
    if attention_mask is None:
        return torch.zeros(q_len, dtype=torch.long), torch.full((q_len,), k_len, dtype=torch.long)
    mask = attention_mask[..., :k_len]
    if mask.dtype == torch.bool or mask.dim() != 4 or mask.shape[0] * mask.shape[1] != 1 or mask.shape[2] != q_len:
        return None
    visible = mask[0, 0] == 0
    if not (visible | (mask[0, 0] == torch.finfo(mask.dtype).min)).all():
        return None  # a bias, not a visibility mask
    count = visible.sum(dim=1)
    first = visible.to(torch.int8).argmax(dim=1)  # the first True
    last = k_len - 1 - visible.flip(1).to(torch.int8).argmax(dim=1)
    if (count == 0).any() or not torch.equal(count, last - first + 1):
        return None
    return first, count


@dataclass
class _Uniform:
    """What `uniform_weights` installs: the attention function (the specification's, in tests) and the memo of the
    projections (`reused_projections`) when one is recording."""

    function: object = uniform_mean_attention
    memo: list = field(default_factory=list)
    reuse: bool = True  # False: every projection computes again (the specification's pass)
    archive: "ProjectionArchive | None" = None  # archived_projections: the real passes' rows, for later passes


_UNIFORM = _Uniform()
AttentionInterface.register(UNIFORM, lambda *args, **kwargs: _UNIFORM.function(*args, **kwargs))


@contextmanager
def uniform_weights(config):
    """Within the block, attention modules built from `config` use uniform weights (they read
    config._attn_implementation at every forward), and a `reused_projections` memo replays what it recorded."""
    saved = config._attn_implementation
    config._attn_implementation = UNIFORM
    for memo in _UNIFORM.memo:
        memo.replaying = _UNIFORM.reuse
    try:
        yield
    finally:
        config._attn_implementation = saved
        for memo in _UNIFORM.memo:
            memo.replaying = False


@contextmanager
def replayed_projections():
    """Within the block, every recording `reused_projections` memo replays what it recorded (the q/k-part variant
    passes, oracle/qk_parts.py, feed the attention projections the same `ah` rows as the real pass), and keeps a
    scope of its own for the block: a projection whose input no real pass recorded (a chain's rows stacked on the
    bridge's were never one pass) is computed by the first variant pass that needs it and handed back to every
    later one with the same input; the scope ends with the block and never replaces the real pass's records."""
    for memo in _UNIFORM.memo:
        memo.replaying, memo.scope = _UNIFORM.reuse, {} if _UNIFORM.reuse else None
    try:
        yield
    finally:
        for memo in _UNIFORM.memo:
            memo.replaying, memo.scope = False, None


@contextmanager
def specified_uniform_weights():
    """Within the block, `uniform_weights` runs the specification: `uniform_attention` (scores and softmax) after
    every projection computed again, as the export did before the means and the memo."""
    saved = _UNIFORM.function, _UNIFORM.reuse
    _UNIFORM.function, _UNIFORM.reuse = uniform_attention, False
    try:
        yield
    finally:
        _UNIFORM.function, _UNIFORM.reuse = saved


class _ProjectionMemo:
    """The last (input, output) of each linear inside the attention modules, recorded outside `uniform_weights` and
    handed back inside it when the input is equal (copies: nothing the forward does later can change them)."""

    def __init__(self, model) -> None:
        self.replaying, self.saved, self.hits = False, {}, 0
        self.scope = None  # replayed_projections' own records: {linear: (weight, input, output)}, None outside it
        self.linears = [m for a in model.modules() if type(a).__name__.endswith("Attention")
                        for m in a.modules() if _is_linear(m) and "forward" not in vars(m)]
        for linear in self.linears:
            linear.forward = self._wrapped(linear, linear.forward)  # an instance attribute over the class's

    def _wrapped(self, linear, forward):
        def memoized(x):
            saved = self.saved.get(linear)
            if self.replaying and saved is not None and saved[0].shape == x.shape and torch.equal(saved[0], x):
                self.hits += 1
                return saved[1]
            scoped = self.scope.get(linear) if self.scope is not None else None
            # the weight too: a variant pass that swapped this linear's weight must compute again
            if (scoped is not None and scoped[0] is linear.weight and scoped[1].shape == x.shape
                    and torch.equal(scoped[1], x)):
                self.hits += 1
                return scoped[2]
            archive = _UNIFORM.archive
            out = archive.assemble(linear, x, forward) if self.replaying and archive is not None else forward(x)
            if not self.replaying:
                self.saved[linear] = (x.clone(), out.clone())
                if archive is not None:
                    archive.record(linear, *self.saved[linear])
            elif self.scope is not None:
                self.scope[linear] = (linear.weight, x.clone(), out.clone())
            return out
        return memoized

    def close(self) -> None:
        for linear in self.linears:
            del linear.forward  # the instance attribute: the class's forward again
        self.saved.clear()
        self.scope = None


class ProjectionArchive:
    """The rows every real pass's attention projections computed (`record`, by the recording memos), handed back
    row by row to a later pass that projects some of the same rows (`assemble`): the q/k-part variants of a
    chain's rows stacked on the bridge's (oracle/qk_parts.py chain_part_records) were never one pass, but each of
    their rows was a row of the bridge's pass or of a chain step's, and an N-layer depth's variants run on that
    depth's own rows. Compared, not assumed: a row is taken only where its input is bit for bit an archived row's
    (a hash finds the candidate, equality decides) under the very weight tensor that projected it (a variant that
    swaps a weight computes again); the other rows are computed, the taken ones are the real pass's own bits. A
    linear's output row reads its input row alone, so the assembled output is the linear's. `skip`: linears never
    archived (the output projections, whose variant inputs are never a real pass's, and which `measure` defers),
    nor is a linear that is not row-wise (_row_wise)."""

    def __init__(self, skip=()) -> None:
        self.skip = {id(linear) for linear in skip}
        self.inputs: list[tuple[torch.Tensor, dict[int, int]]] = []  # (input rows [n, D], {row hash: row})
        self.entries: dict[object, list[tuple[torch.Tensor, int, torch.Tensor]]] = {}  # linear -> (weight, input, out)

    def record(self, linear, x: torch.Tensor, out: torch.Tensor) -> None:
        if id(linear) in self.skip or not _row_wise(linear) or x.dtype != torch.float32 or x.dim() < 2:
            return
        rows = x.reshape(-1, x.shape[-1])
        if self.inputs and self.inputs[-1][0].shape == rows.shape and torch.equal(self.inputs[-1][0], rows):
            index = len(self.inputs) - 1  # q, k and v of one pass read one input: indexed once
        else:
            index = len(self.inputs)
            self.inputs.append((rows, {h: r for r, h in enumerate(_row_hashes(rows))}))
        self.entries.setdefault(linear, []).append((linear.weight, index, out.reshape(len(rows), -1)))

    def assemble(self, linear, x: torch.Tensor, forward) -> torch.Tensor:
        """forward(x), its rows taken from the archive where a real pass projected them, the others computed."""
        entries = [e for e in self.entries.get(linear, ()) if e[0] is linear.weight]
        if not entries or x.dtype != torch.float32 or x.dim() < 2:
            return forward(x)
        rows = x.reshape(-1, x.shape[-1])
        taken = [None] * len(rows)
        for r, h in enumerate(_row_hashes(rows)):
            for weight, index, out in entries:
                found = self.inputs[index][1].get(h)
                if found is not None and torch.equal(self.inputs[index][0][found], rows[r]):
                    taken[r] = out[found]
                    break
        missing = [r for r, t in enumerate(taken) if t is None]
        if len(missing) == len(rows):
            return forward(x)
        result = torch.empty(len(rows), entries[0][2].shape[-1], dtype=entries[0][2].dtype)
        have = [r for r, t in enumerate(taken) if t is not None]
        result[have] = torch.stack([taken[r] for r in have])
        if missing:
            result[missing] = forward(rows[missing]).to(result.dtype)
        return result.reshape(*x.shape[:-1], -1)


def _row_wise(linear) -> bool:
    """A linear whose output row is its input row times one weight, wherever the row sits: torch's and the
    oracle's linears over stored weights; not a grouped one (DeepSeek-V4's o_a_proj: a weight block per group)."""
    from oracle.families.torch_parts import Fp8Linear, UpcastLinear

    return type(linear) in (torch.nn.Linear, UpcastLinear, Fp8Linear)


def _row_hashes(rows: torch.Tensor) -> list[int]:
    data = np.ascontiguousarray(rows.detach().numpy())
    return [hash(row.tobytes()) for row in data]


@contextmanager
def archived_projections(skip=()):
    """Within the block, the recording memos (`reused_projections`) archive every row their attention
    projections compute, and every replaying pass takes its rows from there (ProjectionArchive)."""
    saved, _UNIFORM.archive = _UNIFORM.archive, ProjectionArchive(skip)
    try:
        yield _UNIFORM.archive
    finally:
        _UNIFORM.archive = saved


def _is_linear(module) -> bool:
    """A leaf with a matrix weight: nn.Linear and the oracle's linears over stored weights (UpcastLinear, FP8)."""
    weight = getattr(module, "weight", None)
    return next(module.children(), None) is None and isinstance(weight, torch.Tensor) and weight.dim() == 2


@contextmanager
def reused_projections(model):
    """Within the block, the linears of `model`'s attention modules (class names ending in Attention) remember
    their last output, and a uniform pass (`uniform_weights`) that feeds one the same input gets it back instead of
    a second matmul. Yields the memo (its `hits` count the reuses)."""
    memo = _ProjectionMemo(model)
    _UNIFORM.memo.append(memo)
    try:
        yield memo
    finally:
        _UNIFORM.memo.remove(memo)
        memo.close()


# The probe's default float32 tolerance (probe/tolerance.py DEFAULT). The oracle never imports the probe, so the
# export's warning restates the probe's rule (probe/rule.py RULE) here; tests/probe/test_rule.py holds the two equal
# (and these numbers equal DEFAULT). The probe itself re-judges /evidence/attn_uniform through RULE.
WARN_RTOL, WARN_ATOL = 1e-4, 1e-5


def qk_blind_tokens(attn: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per token: True where uniform weights give the same attn row within the default float32 tolerance, i.e.
    the row cannot witness q/k; only to decide whether the export warns."""
    a = np.asarray(uniform, dtype=np.float64).reshape(len(uniform), -1)
    e = np.asarray(attn, dtype=np.float64).reshape(len(attn), -1)
    with np.errstate(invalid="ignore"):
        max_abs = np.abs(a - e).max(axis=1, initial=0.0)
    e_max = np.abs(e).max(axis=1, initial=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        max_rel = np.where(max_abs == 0, 0.0, max_abs / e_max)
    finite = np.isfinite(a).all(axis=1) & np.isfinite(e).all(axis=1)
    return finite & ((max_rel < WARN_RTOL) | (max_abs < WARN_ATOL))


def qk_warning(num_tokens: int) -> str:
    why = ("T=1: step 0 attends to one key (softmax ≡ 1)" if num_tokens == 1 else
           "every attn row equals the one uniform attention weights give (repeated token and hidden make the "
           "value rows coincide)")
    return (f"warning: these inputs cannot evidence q, k, q_norm, k_norm or RoPE: {why}. A diff against this "
            f"trace can at best be inconclusive about them; export with T >= 2 distinct tokens and hidden rows.")
