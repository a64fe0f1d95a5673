"""Measuring, at export, which attn rows evidence each PART of the q/k path: RoPE, q_norm, k_norm, the KV append,
the sliding window and the attention sink.

`/evidence/attn_uniform` (oracle/attention_evidence.py) says where the attention weights matter at all. It says
nothing about one part: in a head whose attention is saturated (a query's own key wins by a huge margin, or a sink
takes almost all the mass), uniform weights move every row while RoPE removed, the KV append skipped or a window
off by one move none. Evidence about a part must come from that part, so the export runs the family's OFFICIAL
attention module again once per wrong variant of each part (rotary disabled or altered cos/sin, a norm skipped or
in its other form, the current key masked out, another window, no sink) and records, per row, how far the
variant's attn row lies from the real one.

Record: `/evidence/qk_<part>` float32 [T, V], column v = max_i |variant_v attn_i - attn_i| of that row over the
measured columns i (rounded toward zero, so a variant is never recorded as farther than it is): every column up to
MEASURED_COLUMNS wide, else every ⌈D / MEASURED_COLUMNS⌉-th (the output projection runs on those alone: at
Qwen3.5-27B's D = 5120 it was half the records' time). A lower bound of the max over all columns, so a row is
never taken for evidence it would not be: a variant counts as caught only where even that bound fails), and
`evidence_rules["qk_parts"]` = {part: [variant names, in column order]} (inside the evidence digest). The probe
judges each column with the attn stage's own tolerance rule (max_rel = max_abs / max|attn row|): a row evidences variant v of a part only where v
would fail there (probe/evidence.py). A part is evidenced when each of its variants is caught at some compared row.

Families own their variants (oracle/families/*.py `qk_part_variants`: which parts the head has, and how each is
altered in their module); this module holds the family-neutral pieces: the record, the measurement and the small
context managers the families alter their modules with. Every variant pass gets the real pass's q/k/v projections
back where their input is the same (attention_evidence.replayed_projections), so only attention itself and the
output projection run again.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from oracle.attention_evidence import replayed_projections, reused_projections
from oracle.families.torch_parts import UpcastLinear
from oracle.trace import QK_PARTS

PARTS = QK_PARTS  # part -> what a row that evidences it rules out (oracle/trace.py: the record's schema)
PREFIX = "qk_"
BASELINE = "baseline"  # a family's pass without a variant (`baseline`): never recorded, see measure
MEASURED_COLUMNS = 512  # output columns a variant row is measured over, at most (_Deferred.finish)


def dataset_name(part: str) -> str:
    """The /evidence dataset that records `part`'s variants."""
    return PREFIX + part


@dataclass(frozen=True)
class PartVariant:
    """One wrong variant of one part: `run()` returns attn [T, D] as the official module computes it under it."""

    part: str
    name: str
    run: Callable[[], torch.Tensor]

    def rows(self) -> np.ndarray:
        """attn [T, D] float32 under this variant (no autograd: the export's inference mode)."""
        with torch.inference_mode():
            return self.run().detach().to(torch.float32).numpy()


def baseline(run: Callable[[], torch.Tensor]) -> PartVariant:
    """The family's attention pass with no variant, listed first among its variants: `measure` then sends through
    the output projection only the rows a variant changed (the others are the real rows, exactly)."""
    return PartVariant(BASELINE, "none", run)


def measure(variants: list[PartVariant], attn: np.ndarray, output: nn.Module | None = None,
            rows: slice | None = None) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """Run every variant (projections replayed) and return ({dataset: [T, V] max_abs}, {part: [variant names]}).

    `output`: the attention module's last linear (o_proj), whose output the module returns as is. Its inputs are
    then collected over all variant passes and it runs once on their concatenation: one matmul (and one widening
    of a bf16 weight) at V·T rows instead of V at T, the same rows. `rows`: only these rows of each pass are
    measured and returned ([len(rows), V]); `output` then runs on them alone (each output row reads its own input
    row only). Within the call, a projection no real pass recorded is computed by the first variant and handed
    back to the later ones (attention_evidence.replayed_projections).

    A `baseline` pass (the family's pass with no variant, first in `variants`; used only with `output`) gives the
    output projection's input as the real pass has it. A variant row whose input equals it bit for bit is the real
    row: its distance is 0, exactly, and it is not multiplied (a window wider than T, RoPE at position 0, a step
    that sees only its own key anyway). Only the rows a variant changed go through the output projection."""
    keep = rows if rows is not None else slice(None)
    real = np.asarray(attn).reshape(len(attn), -1)[keep]  # sliced before any copy
    base = [v for v in variants if v.part == BASELINE]
    variants = [v for v in variants if v.part != BASELINE]
    columns: dict[str, list[np.ndarray]] = {}
    names: dict[str, list[str]] = {}
    with torch.inference_mode(), replayed_projections():
        with deferred(output, keep) as pending:
            if base and output is not None:
                base[0].rows()
                pending.baseline = pending.inputs.pop()
            computed = [variant.rows() for variant in variants]
        if output is not None:  # the measured columns alone: elsewhere a variant row holds the real row's values
            real = real if pending.columns is None else real[:, pending.columns]
            computed = pending.finish(real)
        else:
            computed = [r.reshape(len(r), -1)[keep] for r in computed]
        real = real.astype(np.float64)
        for variant, rows in zip(variants, computed):
            rows = rows.astype(np.float64).reshape(len(real), -1)
            columns.setdefault(variant.part, []).append(max_abs_toward_zero(rows, real))
            names.setdefault(variant.part, []).append(variant.name)
    return {dataset_name(p): np.stack(c, axis=1) for p, c in columns.items()}, names


def parts_without_evidence(records: dict[str, np.ndarray], names: dict[str, list[str]],
                           attn: np.ndarray) -> dict[str, list[str]]:
    """{part: [variants]} that move no row past the probe's default float32 tolerance (attention_evidence's
    WARN_RTOL/WARN_ATOL): only to decide whether the export warns; the probe judges with the candidate's own."""
    from oracle.attention_evidence import WARN_ATOL, WARN_RTOL

    e_max = np.abs(np.asarray(attn, dtype=np.float64)).max(axis=1, initial=0.0)[:, None]
    missing = {}
    for part, variants in names.items():
        d = records[dataset_name(part)].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            caught = (d >= WARN_ATOL) & ~(d < WARN_RTOL * e_max)
        lost = [v for v, hit in zip(variants, caught.any(axis=0)) if not hit]
        if lost:
            missing[part] = lost
    return missing


def parts_warning(missing: dict[str, list[str]]) -> str:
    named = "; ".join(f"{part} ({', '.join(variants)})" for part, variants in missing.items())
    return (f"warning: on these inputs no attn row moves past the float32 tolerance under these wrong variants of "
            f"the q/k path: {named}. A diff against this trace is at best inconclusive about those parts (a "
            f"saturated attention, where one key or the sink takes almost all the weight, hides them); export with "
            f"other tokens, hidden rows or more steps.")


class _Deferred:
    """The inputs a deferred linear was called with (their rows `keep`, axis -2); `finish` runs it once on all."""

    def __init__(self, linear: nn.Module | None, keep: slice = slice(None)) -> None:
        self.linear, self.inputs, self.keep = linear, [], keep
        self.baseline: torch.Tensor | None = None  # the input without a variant (measure's `baseline` pass)
        self.columns = measured_columns(linear) if linear is not None else None
        self._weight_rows: torch.Tensor | None = None  # the measured columns' weight rows, widened once

    def call(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.detach()[..., self.keep, :]  # rows dropped here are never multiplied
        if self.columns is not None and self.baseline is not None:
            # Measured columns of a wide projection: projected now, the changed rows only, so each variant keeps
            # [changed, columns] instead of its whole input (Qwen3.5-27B-shaped --chain 4: nine 12 MB inputs and
            # their concatenation held at once, the chained export's peak RSS); the same product, row for row.
            flat = rows.reshape(-1, rows.shape[-1])
            changed = self._changed(flat)
            self.inputs.append(_Projected(changed, self._measured(flat[changed])))
        else:
            self.inputs.append(rows.clone())
        return x.new_zeros((*x.shape[:-1], 0))  # a placeholder the attention module hands back unread

    def _changed(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows that differ from the baseline's input (every row without one). NaN != NaN: a NaN row counts as
        changed and is projected, never taken for the real row."""
        base = None if self.baseline is None else self.baseline.reshape(-1, self.baseline.shape[-1])
        if base is None or flat.shape != base.shape:
            return torch.ones(len(flat), dtype=torch.bool)
        return (flat != base).any(dim=1)

    def _measured(self, x: torch.Tensor) -> torch.Tensor:
        """The linear's measured columns of rows x (as _project, its weight rows widened once per measure)."""
        if self._weight_rows is None:
            self._weight_rows = _column_rows(self.linear, self.columns, x.dtype)
        return torch.nn.functional.linear(x, self._weight_rows)

    def finish(self, real: np.ndarray) -> list[np.ndarray]:
        """Each call's output rows over the measured columns ([n, C] float32; C = D where `columns` is None): the
        projection of the rows that differ from the baseline's input (every row without one), those deferred in
        one matmul; `real` ([n, C], the real rows' same columns) where a row equals the baseline's. The columns
        left out would hold the real rows' values: a distance of 0, which `measure` need not compute."""
        deferred = [x.reshape(-1, x.shape[-1]) for x in self.inputs if not isinstance(x, _Projected)]
        changed = [self._changed(x) for x in deferred]
        todo = torch.cat([x[c] for x, c in zip(deferred, changed)]) if deferred else None
        out = _project(self.linear, todo, self.columns) if todo is not None and len(todo) else None
        results, start, later = [], 0, iter(zip(deferred, changed))
        for item in self.inputs:
            if isinstance(item, _Projected):
                c, got = item.changed, item.rows
            else:
                x, c = next(later)
                picked = int(c.sum())
                got, start = (out[start:start + picked] if picked else None), start + picked
            rows = np.array(real, dtype=np.float32).reshape(len(c), -1)  # the real row where nothing is measured
            if got is not None and len(got):
                rows[c.numpy()] = got.to(torch.float32).numpy()
            results.append(rows)
        return results


@dataclass(frozen=True)
class _Projected:
    """A variant call's output already projected (_Deferred.call): its changed rows' measured columns."""

    changed: torch.Tensor
    rows: torch.Tensor


def measured_columns(linear: nn.Module) -> np.ndarray | None:
    """The output columns a variant row is measured over (None: all): every ⌈D / MEASURED_COLUMNS⌉-th where the
    linear is wider and a plain bias-free linear whose weight rows can be taken alone; all columns otherwise."""
    weight = getattr(linear, "weight", None)
    plain = (type(linear) is nn.Linear and linear.bias is None) or type(linear) is UpcastLinear
    if not plain or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or len(weight) <= MEASURED_COLUMNS:
        return None
    return np.arange(0, len(weight), -(-len(weight) // MEASURED_COLUMNS))


def _project(linear: nn.Module, x: torch.Tensor, columns: np.ndarray | None) -> torch.Tensor:
    """linear(x), or its `columns` alone (the weight's rows, widened exactly where stored bf16). The class's own
    forward: no memo (attention_evidence) can hold these rows, and none should copy them."""
    if columns is None:
        return type(linear).forward(linear, x)
    return torch.nn.functional.linear(x, _column_rows(linear, columns, x.dtype))


def _column_rows(linear: nn.Module, columns: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The weight rows of the measured output columns, widened exactly to the activations' dtype."""
    rows = linear.weight[torch.from_numpy(columns)]
    return rows if rows.dtype == dtype else rows.to(dtype)


@contextmanager
def deferred(linear: nn.Module | None, keep: slice = slice(None)) -> Iterator[_Deferred]:
    """Within the block, calls of `linear` are recorded (their rows `keep`, not computed) and return a
    placeholder."""
    pending = _Deferred(linear, keep)
    if linear is None:
        yield pending
        return
    own = vars(linear).get("forward")  # an instance forward (reused_projections' memo) to restore, if any
    linear.forward = pending.call
    try:
        yield pending
    finally:
        if own is None:
            del linear.forward
        else:
            linear.forward = own


def max_abs_toward_zero(rows: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Per row, max |rows - real| as float32 rounded toward zero; a non-finite variant row (it could never pass)
    is recorded as float32's largest value."""
    with np.errstate(invalid="ignore"):
        d = np.abs(rows - real).max(axis=1, initial=0.0)
    d = np.where(np.isfinite(d), d, np.finfo(np.float32).max)
    d32 = d.astype(np.float32)
    return np.where(d32.astype(np.float64) > d, np.nextafter(d32, np.float32(0)), d32).astype(np.float32)


# --- how families alter their official modules for one pass --------------------------------------------------------

@contextmanager
def swapped(owner, name: str, value) -> Iterator[None]:
    """`owner.name` is `value` within the block (a module's weight, sinks, a config flag, a module function)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def fused_attention(attention: nn.Module, mask: torch.Tensor | None):
    """The attention module runs through torch's fused SDPA within the block (its own config's implementation
    swapped): the variant passes' softmax(QK^T)V, 2.2x faster than the eager matmuls at 670 x 670 rows here, within
    float32 rounding of them (7e-7 on unit-scale rows; the Qwen3.5-27B-shaped records within 5e-7 of max|attn| of
    the eager ones, the same rows caught), far under any tolerance the records are judged with. Only with an
    explicit mask (without one SDPA would make the pass causal where eager is not); a family calls it only where
    its attention goes through transformers' attention interface with nothing SDPA lacks (no sinks, no position
    bias): the Qwen stem and Step-3.7, not MiMo (sinks) or Inkling (relative position logits)."""
    config = attention.config
    saved = config._attn_implementation
    if mask is not None:
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = saved


@contextmanager
def skipped(module: nn.Module) -> Iterator[None]:
    """`module` (a norm) returns its input unchanged within the block: the part is absent."""
    module.forward = lambda x, *args, **kwargs: x  # an instance attribute over the class's forward
    try:
        yield
    finally:
        del module.forward


def other_norm_form(norm: nn.Module, one_plus: bool) -> nn.Parameter:
    """A weight that makes `norm` scale by w where it scales by (1 + w) (`one_plus`), or by (1 + w) where it scales
    by w: the norm's own forward then computes the other form (in float32, as both forms multiply)."""
    w = norm.weight.detach().float()
    return nn.Parameter(w - 1.0 if one_plus else w + 1.0, requires_grad=False)


def rotary_off(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0: the module's own RoPE code rotates by nothing (RoPE absent)."""
    return torch.ones_like(cos), torch.zeros_like(sin)


def angles(positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
    """(B, T, dim/2) RoPE angles p · theta^(-2i/dim): the frequencies of a RoPE over `dim` dims."""
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (positions.to(torch.float64)[..., None] * inv_freq).to(torch.float32)


def neox_cos_sin(positions: torch.Tensor, theta: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin in the NeoX-halves layout (cat(freqs, freqs)) for a RoPE over `dim` dims."""
    a = angles(positions, theta, dim)
    a = torch.cat([a, a], dim=-1)
    return a.cos(), a.sin()


def interleaved_pairs(apply_rotary: Callable) -> Callable:
    """A NeoX family's `apply_rotary_pos_emb(q, k, cos, sin)` (its own function: rotary slice first, the rest
    passed through) made to rotate interleaved (GPT-J) pairs (2i, 2i+1) instead of halves (i, i + r/2): each pair is
    de-interleaved first, as transformers' DeepSeek-V3 interleaved RoPE does. q and k get the same permutation, so
    q·k is exactly that of an interleaved RoPE (the module's output reads only q·k). Nothing beyond the family's
    own modules is imported (an export loads only its family's transformers models)."""
    def apply(q, k, cos, sin, *args, **kwargs):
        r = cos.shape[-1]

        def pairs_to_halves(x):
            rot = x[..., :r]
            rot = rot.reshape(*rot.shape[:-1], r // 2, 2).transpose(-1, -2).reshape(rot.shape)
            return torch.cat([rot, x[..., r:]], dim=-1)

        return apply_rotary(pairs_to_halves(q), pairs_to_halves(k), cos, sin, *args, **kwargs)
    return apply


def neox_on_trailing_slice(rotate_half: Callable) -> Callable:
    """DeepSeek-V4's `apply_rotary_pos_emb(x, cos, sin)` (half-size cos/sin, the trailing rope slice of each head
    rotated, the nope channels first) rotating the slice as NeoX halves (cos = cat(freqs, freqs)) instead of V4's
    layout, with the V4 module's own `rotate_half` (in float32, as V4's function)."""
    def apply(x, cos, sin, unsqueeze_dim=1):
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(unsqueeze_dim)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(unsqueeze_dim)
        r = cos.shape[-1]
        rope = x[..., -r:]
        rotated = (rope.float() * cos + rotate_half(rope).float() * sin).to(x.dtype)
        return torch.cat([x[..., :-r], rotated], dim=-1)
    return apply


def without_own_key(mask: torch.Tensor) -> torch.Tensor:
    """The additive (1, 1, T, T) mask with each step's own key blocked (the KV append skipped), from step 1 on;
    step 0 keeps its one key (attending to nothing is no attention row), so the variant never moves row 0."""
    out = mask.clone()
    steps = torch.arange(1, out.shape[-2])
    out[..., steps, steps] = torch.finfo(out.dtype).min
    return out


def only_own_key(mask: torch.Tensor) -> torch.Tensor:
    """The additive (1, 1, T, T) mask with each step seeing its own key only (a KV cache never appended to: each
    step attends to the entry it just wrote)."""
    out = torch.full_like(mask, torch.finfo(mask.dtype).min)
    steps = torch.arange(out.shape[-2])
    out[..., steps, steps] = 0.0
    return out


def kv_append_variants(run: Callable, mask: torch.Tensor) -> list[PartVariant]:
    """The KV append's two wrong variants, from a family's pass factory `run(attention_mask=...)` and its real
    mask: the current key missing, and only the current key (the cache never grows)."""
    return [PartVariant("kv_append", "own_key_missing", run(attention_mask=without_own_key(mask))),
            PartVariant("kv_append", "only_own_key", run(attention_mask=only_own_key(mask)))]


# --- the same records at every chain depth (export --chain) ---------------------------------------------------------

@dataclass(frozen=True)
class DepthRows:
    """What depth j of the chains fed and computed: the rows its q/k-part records are measured on."""

    token_ids: np.ndarray  # (n_j,)
    positions: np.ndarray  # (n_j,) p_i + j - 1
    recycled: np.ndarray  # (n_j, w)
    embed: np.ndarray  # (n_j, D)
    ah: np.ndarray  # (n_j, D)
    attn: np.ndarray  # (n_j, D): the reference's depth-j attn rows, what each variant is measured against


def chain_part_records(impl, head, rotary, inputs, bridge_ah: np.ndarray, bridge_attn: np.ndarray,
                       depths: dict[int, DepthRows], names: dict[str, list[str]],
                       block: int | None = None) -> dict[int, dict[str, np.ndarray]]:
    """{depth j: {/chain/d{j}/evidence dataset: [n_j, V]}}: each q/k-path part's wrong variants measured on the
    chain's own depth-j attn rows, as depth 1's are on the bridge's (one-layer heads).

    The rows are the draft loop's own (oracle/draft_loop.py): the bridge steps, then every depth's chain entries,
    stacked as one pass of the official attention module on the reference's `ah` rows, with the loop's mask (chain c
    at depth j sees bridge rows 0..c and its own entries of depths 2..j, within the window) and its key positions
    (bridge i at p_i, chain c's depth-d entry at p_c + d - 1). A variant then applies wherever the head attends
    (the bridge keys a chain reads included, as an engine wrong in that part is), its inputs held at the
    reference's, and only the depth-j rows are kept for depth j. With the same mask and no variant this pass gives
    the loop's own attn rows (tests/probe/test_qk_parts_depths.py). Only the parts whose variants are depth 1's
    (`names`, the root's evidence_rules.qk_parts, which the probe reads at every depth) are kept. As the loop does,
    chains go in blocks (`block`, default draft_loop.CHAIN_BLOCK): a block's pass holds the bridge rows its chains
    may see and their entries only, so its scores stay (T + block·(K-1))² per head, not (T·K)²."""
    from oracle.draft_loop import CHAIN_BLOCK

    order = sorted(depths)
    sizes = [len(depths[j].token_ids) for j in order]  # n_j, non-increasing: chains 0..n_j-1 have depth j
    block = block or CHAIN_BLOCK
    out: dict[int, dict[str, np.ndarray]] = {j: {} for j in order}
    for a in range(0, sizes[0], block):
        b = min(a + block, sizes[0])  # chains a..b-1 see bridge rows 0..b-1 at most
        counts = tuple(m for m in (max(0, min(b, n) - a) for n in sizes) if m)
        records, measured = _block_records(impl, head, rotary, inputs, bridge_ah, bridge_attn, depths, order, a, b,
                                           counts)
        kept = {dataset_name(p) for p, v in measured.items() if names.get(p) == v}
        start = 0  # the chain rows only: _block_records measures no bridge row
        for j, m in zip(order, counts):
            for name in kept:
                rows = records[name]
                target = out[j].setdefault(name, np.zeros((sizes[order.index(j)], rows.shape[1]), np.float32))
                target[a:a + m] = rows[start:start + m]
            start += m
    return out


def _block_records(impl, head, rotary, inputs, bridge_ah, bridge_attn, depths, order, a: int, b: int,
                   counts: tuple[int, ...]):
    """measure() over bridge rows 0..b-1 then chains a..a+m_j-1 of each depth (counts = m_j): one pass per variant,
    the chain rows' distances returned ([sum(counts), V]). The bridge rows' own distances are depth 1's business:
    they are keys and values here, never measured (nor sent through the output projection)."""
    from oracle.draft_loop import key_positions, within_window
    from oracle.trace import TraceInputs

    bridge_positions = torch.from_numpy(np.asarray(inputs.positions[:b], dtype=np.int64))
    keys = key_positions(a, bridge_positions, counts)  # the stacked rows' positions
    mask = stacked_mask(b, counts, first=a)
    part = [(depths[j], slice(a, a + m)) for j, m in zip(order, counts)]
    stacked = TraceInputs(
        token_ids=np.concatenate([inputs.token_ids[:b], *(d.token_ids[s] for d, s in part)]).astype(np.int64),
        positions=keys.numpy(), hidden=np.concatenate([inputs.hidden[:b], *(d.recycled[s] for d, s in part)]),
        embed=np.concatenate([inputs.embed[:b], *(d.embed[s] for d, s in part)]))
    ah = np.concatenate([bridge_ah[:b], *(d.ah[s] for d, s in part)]).astype(np.float32)
    attn = np.concatenate([bridge_attn[:b], *(d.attn[s] for d, s in part)])
    variants = impl.qk_part_variants(head, rotary, stacked, ah, mask_of=lambda w: within_window(mask, keys, keys, w))
    with reused_projections(head):  # no real pass was this stacked one: its variants share one projection pass
        return measure(variants, attn, impl.qk_output_projection(head), rows=slice(b, None))


def stacked_mask(bridge_rows: int, counts: tuple[int, ...], first: int = 0) -> torch.Tensor:
    """Additive (1, 1, R, R) mask over the bridge rows then each depth's chain entries (`counts` per depth, chains
    first..): bridge rows causal, the rows of depth 2 + d the draft loop's chain_mask after counts[:d + 1], keys of
    later depths blocked. R = bridge_rows + sum(counts)."""
    from oracle.draft_loop import chain_mask

    total = bridge_rows + sum(counts)
    blocks = [chain_mask(0, bridge_rows, ())]  # the bridge, causal
    blocks += [chain_mask(first, bridge_rows, counts[:d]) for d in range(1, len(counts) + 1)]
    low = torch.finfo(torch.float32).min
    padded = [torch.nn.functional.pad(b, (0, total - b.shape[-1]), value=low) for b in blocks]
    return torch.cat(padded, dim=-2)


def layer_part_records(impl, head, rotary, depths: dict[int, DepthRows],
                       layers: dict[int, int]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, list[str]]]]:
    """{depth j: ({/chain/d{j}/evidence dataset: [n_j, V]}, {part: [variant names]})} for an N-layer head
    (transformers' MtpModel) whose chains were teacher-forced: each depth's q/k-path parts measured on the layer
    that depth ran (`layers[j]`: j-1, or (j-1) % N under --chain-layers modulo) with that layer's own parts.

    Teacher-forced, depth j of such a head is one causal pass of its layer over its n_j rows, at positions p_i + j
    - 1, through a cache of its own that starts empty (oracle/draft_loop.py _layer_pass): no bridge or other
    depth's keys. So the depth's rows are measured as depth 1's are on the bridge (the family's qk_part_variants
    with its default causal, windowed mask), on the depth's own `ah`, against its own `attn`. The variant names
    are the layer's own (a sliding layer has a window part, a partial-rotary one RoPE all_dims), recorded per depth
    in evidence_rules.qk_parts_at_depth: the probe reads a depth's columns by them, never by depth 1's."""
    from oracle.trace import TraceInputs

    out = {}
    for j, rows in sorted(depths.items()):
        layer = layers[j]
        inputs = TraceInputs(token_ids=np.asarray(rows.token_ids, dtype=np.int64),
                             positions=np.asarray(rows.positions, dtype=np.int64), hidden=rows.recycled,
                             embed=rows.embed)
        variants = impl.qk_part_variants(head, rotary, inputs, np.asarray(rows.ah, dtype=np.float32), layer=layer)
        with reused_projections(head):  # nor was this depth's pass a real one: its variants share one projection
            out[j] = measure(variants, rows.attn, impl.qk_output_projection(head, layer=layer))
    return out
