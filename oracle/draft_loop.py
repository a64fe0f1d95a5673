"""The draft loop: the one implementation of a head's chains (shared/DESIGN.md "The draft loop"), used by
`mtp-oracle export --chain K` and `mtp-oracle accept`.

Bridge step i consumes (x_{i+1}, H_i, p_i); its K/V entry is the head's permanent cache row for p_i. The chain from
bridge i runs depths j = 2..K:
- token c_{i,j}: teacher-forced x_{i+j} (the step tokens' token_ids[i+j-1]), or the head's own draft j-1 (argmax);
- recycled hidden r_{i,j}: the `recycle` stage of depth j-1 (the bridge step's for j = 2): the family's convention
  (FamilySpec.recycled: `out` for Qwen, DeepSeek-V3 and GLM; V4 its block's output streams) or an export option;
- position p_i + j - 1; layer l(j) = 0 (one-layer heads; `layers` in the trace leaves room for N-layer heads);
- KV: chain i sees bridge rows 0..i and its own chain entries, never another chain's; afterwards the cache holds
  exactly bridge rows 0..i (the chain's entries are dropped), so bridge step i+1 never sees a draft entry.

How. All bridge steps run as one causal pass through a DynamicCache (`bridge_pass`): its keys and values are the
bridge rows. Then depth by depth (`run_chains`), the chains in blocks: a block's cache starts as the bridge rows its
chains may see, each depth appends one entry per chain, and `chain_mask` lets chain c see bridge rows <= c and its
own entries only. A block's cache is discarded after the last depth: no chain entry ever reaches a bridge row,
because the bridge rows were computed before any chain ran. A family with a sliding window (FamilySpec.
attention_window) has every query see only the keys within W positions, itself included (`within_window`).

Each depth runs every stage of the family (`head.steps`: stages plus routing evidence) and, where asked, the
draft (the argmax of the family's draft projection on `out`, oracle/lm_head.py), the attention evidence under
uniform weights (oracle/attention_evidence.py) and the recycle alternatives (h_if_prenorm, h_if_main).
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import DynamicCache

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.families.registry import head_module
from oracle.lm_head import CHUNK_ROWS, LM_HEAD, LmHead, lm_head_of

CHAIN_BLOCK = 256  # chains per attention call: its scores take heads x block x (bridge + block * k) floats
TEACHER, ARGMAX = "teacher_forced", "argmax"
TOKEN_MODES = {"teacher": TEACHER, "argmax": ARGMAX}  # the CLI's --chain-tokens -> the trace's `chain.tokens`
KV_DROPPED = "dropped_after_chain"
Rotary = torch.nn.Module
Stages = dict[str, torch.Tensor]
Draft = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]  # out rows [n, D] -> (ids [n], margin | None)


class Head(Protocol):
    """What the loop needs of any family's head (oracle/families/*.py)."""

    text_config: object

    def steps(self, rotary: Rotary, embed: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None, cache: DynamicCache | None) -> Stages:
        """Steps (1, n, ·) at `positions` (1, n) under an additive `mask` through `cache` -> {stage: (1, n, w)}
        and the routing evidence (topk_margin, ...)."""

    def hidden_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stage `h` of a hidden (1, n, w)."""

    def uniform_attention(self, rotary: Rotary, ah: torch.Tensor, positions: torch.Tensor,
                          mask: torch.Tensor | None, cache: DynamicCache | None) -> torch.Tensor:
        """`attn` (1, n, D) of `ah` with uniform weights over the keys `mask` lets through."""


@dataclass(frozen=True)
class Bridge:
    """Bridge steps 0..n-1 through the head: every stage (n, w) and the K/V they leave in its cache."""

    stages: Stages  # {stage or evidence name: (n, w)}
    positions: torch.Tensor  # (n,) p_i
    keys: torch.Tensor  # (1, kv_heads, n, head_dim), as the cache holds them (after k_norm and RoPE)
    values: torch.Tensor
    hidden: torch.Tensor  # (n, w): H_i, what `main` recycling would feed at every depth

    @property
    def rows(self) -> int:
        return len(self.positions)


@dataclass
class Depth:
    """Depth j >= 2 of the chains from bridge rows 0..n-1: what each row was fed and what the head computed."""

    depth: int
    token_ids: np.ndarray  # (n,) c_{i,j}
    positions: np.ndarray  # (n,) p_i + j - 1
    recycled: torch.Tensor  # (n, w) r_{i,j}
    embed: np.ndarray  # (n, D) embedding rows of token_ids
    stages: Stages  # {name: (n, w)}: the kept stages and evidence of the head
    drafts: np.ndarray | None = None  # (n,) argmax of the draft projection on `out`
    margins: np.ndarray | None = None  # (n,) its top-1 minus top-2 logit, where the projection gives it
    evidence: dict[str, np.ndarray] = field(default_factory=dict)  # attn_uniform, h_if_prenorm, h_if_main
    layer_index: int = 0  # the physical MTP layer this depth ran (one-layer heads: 0)
    cache_rows: tuple | None = None  # N-layer heads: the (keys, values) this depth's pass left in its layer's cache

    @property
    def rows(self) -> int:
        return len(self.token_ids)

    @property
    def bridge(self) -> np.ndarray:
        return np.arange(self.rows, dtype=np.int64)

    @property
    def layer(self) -> np.ndarray:
        return np.full(self.rows, self.layer_index, dtype=np.int64)


def chain_rows(num_steps: int, depth: int) -> int:
    """Bridge rows that have depth j: bridge i feeds x_{i+j} = token_ids[i+j-1], so i + j - 1 <= T - 1."""
    return max(num_steps - depth + 1, 0)


@torch.inference_mode()
def bridge_pass(head: Head, rotary: Rotary, embed: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
                window: int | None) -> Bridge:
    """Bridge steps (embed [n, D], H [n, w], positions [n]) as one causal (windowed) pass through a cache."""
    e = torch.from_numpy(np.ascontiguousarray(embed, dtype=np.float32))[None]  # (n, D) -> (1, n, D)
    h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))[None]  # (n, w) -> (1, n, w)
    p = torch.from_numpy(np.asarray(positions, dtype=np.int64))
    n = len(p)
    if hasattr(head, "window"):  # N-layer heads: the bridge runs layer 0, whose window its module reads
        window = head.window(0)
    mask = within_window(chain_mask(0, n, ()), p, p, window)
    # The head's own cache, holding every key: a window is the mask's job, so the chains can see the bridge keys
    # their own windows reach (a sliding-window cache would keep only the last W-1).
    cache = _new_cache(head)
    stages = head.steps(rotary, e, h, p[None], mask, cache)
    keys, values, _ = next(iter(cache))
    return Bridge({name: rows[0] for name, rows in stages.items()}, p, keys, values, h[0])  # (1, n, w) -> (n, w)


def chain_mask(first: int, bridge_keys: int, counts: tuple[int, ...]) -> torch.Tensor:
    """Additive mask (1, 1, m, bridge_keys + sum(counts)) for chains first..first+m-1 at the depth after `counts`.

    Keys: bridge rows 0..bridge_keys-1, then counts[d] chain entries per earlier depth and the current one (chains
    first.., in order; counts never grow with depth, m = counts[-1]). Chain c sees bridge rows 0..c and its own
    entries, never another chain's. counts == (): the bridge pass itself, m = bridge_keys, causal."""
    m = counts[-1] if counts else bridge_keys
    chain = torch.arange(first, first + m)
    sees_bridge = torch.arange(bridge_keys)[None, :] <= chain[:, None]  # (m, bridge_keys)
    sees_own = [torch.eye(m, count, dtype=torch.bool) for count in counts]  # (m, count) each
    allowed = torch.cat([sees_bridge, *sees_own], dim=1)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def key_positions(first: int, bridge: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """Positions of chain_mask's keys: bridge row i at p_i; chain c's entry of depth d at p_c + d - 1."""
    entries = [bridge[first:first + count] + (d - 1) for d, count in enumerate(counts, start=2)]
    return torch.cat([bridge, *entries])


def within_window(mask: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """`mask` with every key at or beyond `window` positions behind its query blocked as well: a query at p sees
    keys at p-W+1..p, as a stepwise run through the window cache (W-1 kept, plus itself) does. None: unchanged."""
    if window is None:
        return mask
    outside = keys[None, :] <= queries[:, None] - window  # (n, keys)
    return mask.masked_fill(outside[None, None], torch.finfo(torch.float32).min)


@dataclass(frozen=True)
class ChainSpec:
    """What a run of chains feeds and records (see the module docstring)."""

    depths: int  # K: depths 2..K run
    rows: Callable[[int], int]  # depth j -> bridge rows 0..n_j-1 that have it (non-increasing in j)
    tokens: str = TEACHER  # TEACHER: token_ids[i+j-1]; ARGMAX: the previous depth's draft
    token_ids: np.ndarray | None = None  # the step tokens (TEACHER)
    recycle: str = "out"  # the stage depth j-1 hands to depth j
    window: int | None = None
    keep: tuple[str, ...] | None = None  # stages a Depth keeps (None: all); the recycled one is kept anyway
    prenorm: str | None = None  # the recycle alternative recorded as h_if_prenorm (None: not recorded)
    record_main: bool = False  # h_if_main: the `h` of recycling H_i at every depth
    uniform: bool = False  # attn_uniform per depth
    chain_block: int = CHAIN_BLOCK
    layers: Callable[[int], int] | None = None  # depth j -> the physical layer (None: 0, N-layer heads j-1)
    # Loop variants (oracle/loop_variants.py, `--explain`): an engine's wrong loop, run by this same loop.
    recycle_main: bool = False  # every depth recycles the main model's H_i (recycle_main_hidden)
    position_step: int = 1  # depth j at p_i + (j-1)·step; 0: the chain position never advances (position_frozen)
    # depth j -> the tokens (n_j,) a reference recorded at depth j: fed instead of the token mode's choice, so a
    # variant on an argmax-chain reference runs on the reference's drafts, never its own (`tokens` keeps the rows'
    # structure: an N-layer argmax chain's own rows read these as the chain's drafts)
    fed: Callable[[int], np.ndarray] | None = None
    # N-layer heads, teacher-forced: depth j -> (keys, values) of another layer's pass (layer_caches_swapped): row s
    # of depth j attends over those rows r < s and its own row s, instead of its own rows <= s
    past_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # N-layer heads: run layer 0 through its one cache at every depth, as a one-layer head's loop does (bridge
    # entries, then the chain's own, dropped after it): layer0_reused as vLLM's proposer without spec_step_idx
    # runs it (the drafts' K/V land in layer 0's cache slots, which the next bridge step overwrites)
    one_cache: bool = False
    # N-layer argmax chains: each layer's cache holds the rows the chains wrote at its depth, in the engine's order
    # (bridge i, its chain, bridge i+1: vLLM), instead of the teacher-forced rows MtpModel.forward over the prefix
    # recomputes (`export --chain-kv engine`; teacher-forced chains: the two are the same)
    engine_kv: bool = False
    record_layer0: bool = False  # N-layer heads: out_if_layer0, the out of layer 0 at a depth that runs another

    def offset(self, depth: int) -> int:
        """Depth j's position minus its bridge's: j - 1 (0 for a frozen chain position)."""
        return (depth - 1) * self.position_step

    def recycled(self, stages: Stages, bridge: "Bridge", n: int) -> torch.Tensor:
        """The hidden the first n rows of the next depth read: `stages[recycle]`, or H_i (recycle_main)."""
        return bridge.hidden[:n] if self.recycle_main else stages[self.recycle][:n]


@torch.inference_mode()
def run_chains(head: Head, rotary: Rotary, bridge: Bridge, spec: ChainSpec,
               embedding_rows: Callable[[np.ndarray], np.ndarray], draft: Draft | None = None,
               first_drafts: np.ndarray | None = None) -> Iterator[Depth]:
    """Depths 2..K of the chains from `bridge`, one Depth at a time (all its chains), in blocks of chains.

    `draft` (out rows -> ids, margin) drafts every depth; the ARGMAX token mode feeds depth j the draft of depth
    j-1 (`first_drafts`: the bridge's, depth 1's)."""
    if spec.tokens == ARGMAX and spec.fed is None and (draft is None or first_drafts is None):
        raise ValueError("argmax chain tokens need the draft projection and depth 1's drafts")  # a caller bug
    if getattr(head, "num_layers", 1) > 1 and not spec.one_cache:
        yield from _layer_chains(head, rotary, bridge, spec, embedding_rows, draft, first_drafts)
        return
    blocks = [(a, min(a + spec.chain_block, bridge.rows)) for a in range(0, spec.rows(2), spec.chain_block)]
    # A block's cache starts as the bridge rows its chains may see; chain entries are appended, then dropped.
    caches = [DynamicCache([(bridge.keys[:, :, :b], bridge.values[:, :, :b])]) for _, b in blocks]
    counts: list[tuple[int, ...]] = [() for _ in blocks]  # chain entries per depth in each block's cache
    previous, drafts = bridge.stages, first_drafts
    for depth in range(2, spec.depths + 1):
        n = spec.rows(depth)
        if n == 0:
            return
        tokens = (spec.fed(depth)[:n] if spec.fed is not None else spec.token_ids[depth - 1:depth - 1 + n]
                  if spec.tokens == TEACHER else drafts[:n]).astype(np.int64)
        embed = np.ascontiguousarray(embedding_rows(tokens), dtype=np.float32)
        recycled = spec.recycled(previous, bridge, n)
        steps, uniform = [], []
        for index, (a, b) in enumerate(blocks):
            m = min(b, n) - a
            if m <= 0:
                continue
            counts[index] += (m,)
            stages, attn = _chain_step(head, rotary, caches[index], bridge.positions[:b], a, counts[index],
                                       torch.from_numpy(embed[a:a + m]), recycled[a:a + m], depth, spec)
            steps.append(stages)
            uniform.append(attn)
        stages = {name: torch.cat([s[name] for s in steps]) for name in steps[0]}
        positions = (bridge.positions[:n] + spec.offset(depth)).numpy()
        result = Depth(depth, tokens, positions, recycled, embed, stages)
        if spec.uniform:
            result.evidence["attn_uniform"] = torch.cat(uniform).numpy()
        _recycle_alternatives(head, bridge, previous, spec, n, result)
        if draft is not None:
            result.drafts, result.margins = draft(stages["out"].numpy())
            drafts = result.drafts
        if spec.keep is not None:  # the next depth reads its recycled (and pre-norm) rows from this one
            keep = {*spec.keep, spec.recycle, *([spec.prenorm] if spec.prenorm else [])}
            result.stages = {k: v for k, v in stages.items() if k in keep}
        previous = result.stages
        yield result


def _layer_chains(head, rotary: Rotary, bridge: Bridge, spec: ChainSpec,
                  embedding_rows: Callable[[np.ndarray], np.ndarray], draft: Draft | None,
                  first_drafts: np.ndarray | None) -> Iterator[Depth]:
    """Depths 2..K of an N-layer head (transformers' MtpModel): depth j runs layer spec.layers(j) (default j-1).

    As MtpModel.forward drafts from bridge c, the layer at depth j = d+1 runs over rows s = 0..c: rows s <= c-d
    are teacher-forced (token x_{s+j}, recycled the depth-d row of bridge s), and rows s = c-d+m, m = 1..d, read
    the chain's own drafts d_m (the tokens x_{s+j} stands for are not known yet), recycling the previous depth's
    row s of the same chain. Teacher-forced chains: every row is teacher-forced, so depth j is one causal
    (windowed) pass over its n_j rows. Argmax chains: the teacher-forced rows are that pass (the layer's cache),
    then every chain's d rows in one batch, each chain seeing the cache rows <= c-d and its own rows; the depth's
    row c is the chain's row m = d (position p_c + d)."""
    layer_of = spec.layers or (lambda depth: depth - 1)
    teacher, chain_rows_prev, drafts = bridge.stages, None, first_drafts
    own = bridge.stages  # engine_kv: the previous depth's rows of every chain (row c = chain c)
    chain_drafts = None if drafts is None else drafts[:, None].astype(np.int64)  # (n, 1): d_1 of each chain
    for depth in range(2, spec.depths + 1):
        n = spec.rows(depth)
        if n == 0:
            return
        layer, d = layer_of(depth), depth - 1
        if not 0 <= layer < head.num_layers:
            raise InputError(f"depth {depth} would run MTP layer {layer}, and the head has {head.num_layers} "
                             f"(depth j runs layer j-1): use at most {head.num_layers} depths (accept --k, export "
                             f"--chain), or export --chain-layers modulo (vLLM's spec_step_idx % N).")
        if spec.tokens != TEACHER and spec.engine_kv:
            # Engine order: depth j of chain c attends over the entries depth j of chains 0..c-1 left in the
            # layer's cache and its own, so the depth is one causal pass of the layer over the chains' own rows
            # (row c: chain c's token, recycling chain c's previous depth row c).
            tokens = (spec.fed(depth)[:n] if spec.fed is not None else drafts[:n]).astype(np.int64)
            positions = bridge.positions[:n] + spec.offset(depth)
            result = _layer_pass(head, rotary, layer, positions, tokens, spec.recycled(own, bridge, n),
                                 embedding_rows, spec, depth)
            if spec.record_layer0 and layer != 0:
                result.evidence["out_if_layer0"] = _layer_pass(
                    head, rotary, 0, positions, tokens, spec.recycled(own, bridge, n), embedding_rows,
                    _evidence_spec(spec), depth).stages["out"].numpy()
            result.depth, previous, own = depth, own, result.stages
            _depth_evidence(head, bridge, previous, spec, n, layer, result)
            if draft is not None:
                result.drafts, result.margins = draft(result.stages["out"].numpy())
                drafts = result.drafts
            yield result
            continue
        n_tf = n if spec.tokens == TEACHER else max(n - d, 0)
        if spec.tokens != TEACHER and (spec.recycle_main or spec.position_step != 1):
            raise ValueError("recycle_main / position_step are teacher-forced loop variants on N-layer heads")
        positions = bridge.positions[:n_tf] + spec.offset(depth)
        tokens = (spec.fed(depth)[:n_tf] if spec.fed is not None and spec.tokens == TEACHER
                  else spec.token_ids[d:d + n_tf]).astype(np.int64)
        tf = _layer_pass(head, rotary, layer, positions, tokens, spec.recycled(teacher, bridge, n_tf), embedding_rows,
                         spec, depth)
        tf0 = None  # record_layer0: the same teacher-forced rows through layer 0 (its weights, its own pass)
        if spec.record_layer0 and layer != 0:
            tf0 = _layer_pass(head, rotary, 0, positions, tokens, spec.recycled(teacher, bridge, n_tf),
                              embedding_rows, _evidence_spec(spec), depth)
        if spec.tokens == TEACHER:
            result, previous = tf, teacher
            if tf0 is not None:
                result.evidence["out_if_layer0"] = tf0.stages["out"].numpy()
        else:
            if spec.fed is not None:  # the chains' drafts d_1..d_d are the recorded tokens of depths 2..j
                chain_drafts = np.stack([spec.fed(m + 1)[:n] for m in range(1, depth)], axis=1).astype(np.int64)
            # a head whose layers keep conv states runs each chain apart (oracle/families/mtp_model.py own_rows)
            own_rows = getattr(head, "own_rows", _own_rows)
            if tf0 is not None:  # before the chains' rows of this depth replace chain_rows_prev
                alt = own_rows(head, rotary, 0, d, n, bridge, tf0, teacher, chain_rows_prev, chain_drafts,
                               embedding_rows, _evidence_spec(spec))[0]
            result, chain_rows_prev, previous = own_rows(head, rotary, layer, d, n, bridge, tf, teacher,
                                                         chain_rows_prev, chain_drafts, embedding_rows, spec)
            if tf0 is not None:
                result.evidence["out_if_layer0"] = alt.stages["out"].numpy()
        result.depth = depth
        _depth_evidence(head, bridge, previous, spec, n, layer, result)
        if draft is not None:
            result.drafts, result.margins = draft(result.stages["out"].numpy())
            if chain_drafts is not None:
                chain_drafts = np.concatenate([chain_drafts[:n], result.drafts[:, None].astype(np.int64)], axis=1)
        teacher = tf.stages
        yield result


def _evidence_spec(spec: ChainSpec) -> ChainSpec:
    """`spec` for an evidence pass: no uniform attention, no swapped caches, nothing recorded."""
    return dataclasses.replace(spec, uniform=False, past_kv=None, prenorm=None, record_main=False)


def _depth_evidence(head, bridge: Bridge, previous: Stages, spec: ChainSpec, n: int, layer: int, result: Depth) -> None:
    """h_if_prenorm / h_if_main of an N-layer depth (see _recycle_alternatives), through `layer`'s hidden norm."""
    if spec.prenorm is not None:
        result.evidence["h_if_prenorm"] = head.hidden_norm(previous[spec.prenorm][:n][None], layer=layer)[0].numpy()
    if spec.record_main:
        result.evidence["h_if_main"] = head.hidden_norm(bridge.hidden[:n][None], layer=layer)[0].numpy()


def _layer_pass(head, rotary: Rotary, layer: int, positions: torch.Tensor, tokens: np.ndarray,
                recycled: torch.Tensor, embedding_rows: Callable[[np.ndarray], np.ndarray], spec: ChainSpec,
                depth: int = 0) -> Depth:
    """Teacher-forced rows of one depth through `layer` as one causal (windowed) pass; the cache it fills is the
    layer's cache the chains of that depth see (kept in `cache_rows`)."""
    n = len(tokens)
    embed = np.ascontiguousarray(embedding_rows(tokens), dtype=np.float32)
    e, p = torch.from_numpy(embed)[None], positions[None]
    mask = within_window(chain_mask(0, n, ()), positions, positions, head.window(layer))
    cache = _new_cache(head)
    past = (spec.past_kv or {}).get(depth)
    if past is not None and n:  # layer_caches_swapped: another layer's rows r < s, then this pass's own row s
        keys, values = past[0][:, :, :n], past[1][:, :, :n]
        mask = _past_mask(keys.shape[2], n, head.window(layer))
        cache.update(keys, values, layer)
    from oracle.attention_evidence import reused_projections

    with reused_projections(head):  # the uniform pass (and an archive's later passes) reuse its q/k/v projections
        stages = {k: v[0] for k, v in head.steps(rotary, e, recycled[None], p, mask, cache, layer=layer).items()}
        result = Depth(0, tokens, positions.numpy(), recycled, embed, stages, layer_index=layer)
        if n:
            result.cache_rows = (cache.layers[layer].keys[:, :, -n:], cache.layers[layer].values[:, :, -n:])
        if spec.uniform and n:
            cache = _new_cache(head)  # the pass's cache without its n rows: it started empty
            result.evidence["attn_uniform"] = head.uniform_attention(rotary, stages["ah"][None], p, mask, cache,
                                                                     layer=layer)[0].numpy()
    return result


def _past_mask(rows: int, n: int, window: int | None) -> torch.Tensor:
    """(1, 1, n, rows + n) for a pass of n rows over a cache prefilled with another layer's `rows` rows
    (layer_caches_swapped): row s sees those rows r < s (within the window, counted in rows as a cache counts
    slots) and its own row s."""
    r, s = torch.arange(rows)[None, :], torch.arange(n)[:, None]
    sees_past = (r < s) & (r > s - (window if window is not None else n + 1))
    allowed = torch.cat([sees_past, torch.eye(n, dtype=torch.bool)], dim=1)
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def _new_cache(head) -> DynamicCache:
    """An empty cache for one pass: the family's own where it has one (short-convolution states: MtpCache)."""
    return head.new_cache() if hasattr(head, "new_cache") else DynamicCache()


def _own_rows(head, rotary: Rotary, layer: int, d: int, n: int, bridge: Bridge, tf: Depth, teacher: Stages,
              previous_rows: dict | None, chain_drafts: np.ndarray, embedding_rows, spec: ChainSpec):
    """Every chain's rows m = 1..d at this depth (see _layer_chains) in one batch over the layer's cache: the
    depth's record (row c = the chain's row m = d), the rows the next depth recycles ({name: (n, d, w)}), and the
    rows this depth recycled from (for h_if_prenorm)."""
    q = [(c, m, c - d + m) for c in range(n) for m in range(1, d + 1) if c - d + m >= 0]
    qc, qm, qs = (torch.tensor([x[i] for x in q]) for i in range(3))
    keep = {spec.recycle, *([spec.prenorm] if spec.prenorm else [])}
    # recycled: m = 1 reads the previous depth's teacher-forced row s; m >= 2 this chain's previous row m-1
    recycled_from = {name: torch.stack([teacher[name][s] if m == 1 else previous_rows[name][c, m - 2]
                                        for c, m, s in q]) for name in keep}
    tokens = np.array([chain_drafts[c, m - 1] for c, m, _ in q], dtype=np.int64)
    embed = np.ascontiguousarray(embedding_rows(tokens), dtype=np.float32)
    positions = bridge.positions[qs] + d
    n_tf = len(tf.token_ids)
    sees_cache = torch.arange(n_tf)[None, :] <= (qc - d)[:, None]  # (Q, n_tf)
    sees_own = (qc[:, None] == qc[None, :]) & (qm[None, :] <= qm[:, None])  # (Q, Q)
    allowed = torch.cat([sees_cache, sees_own], dim=1)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    keys = torch.cat([bridge.positions[:n_tf] + d, positions])
    mask = within_window(mask, positions, keys, head.window(layer))
    cache = DynamicCache()
    if tf.cache_rows is not None:
        cache.update(*tf.cache_rows, layer)
    e, p = torch.from_numpy(embed)[None], positions[None]
    stages = {k: v[0] for k, v in head.steps(rotary, e, recycled_from[spec.recycle][None], p, mask, cache,
                                             layer=layer).items()}
    last = qm == d  # the chain's own row at this depth: row c (q is ordered by c, every c has m = d)
    uniform = None
    if spec.uniform:
        cache.crop(-len(q))
        uniform = head.uniform_attention(rotary, stages["ah"][None], p, mask, cache, layer=layer)[0][last].numpy()
    rows = {}
    for name in keep:
        dense = torch.zeros(n, d, stages[name].shape[-1])
        dense[qc, qm - 1] = stages[name]
        rows[name] = dense
    record = Depth(0, tokens[last.numpy()], positions[last].numpy(), recycled_from[spec.recycle][last],
                   embed[last.numpy()], {k: v[last] for k, v in stages.items()}, layer_index=layer)
    if uniform is not None:
        record.evidence["attn_uniform"] = uniform
    return record, rows, {name: t[last] for name, t in recycled_from.items()}


def _chain_step(head, rotary: Rotary, cache: DynamicCache, bridge_positions: torch.Tensor, first: int,
                counts: tuple[int, ...], embed: torch.Tensor, recycled: torch.Tensor, depth: int,
                spec: ChainSpec) -> tuple[Stages, torch.Tensor | None]:
    """One depth of chains first..first+m-1 (m = counts[-1]; chain c's query at p_c + depth - 1) through the
    block's cache: its stages (m, w), and `attn` under uniform weights over the same keys when asked."""
    m = counts[-1]
    positions = bridge_positions[first:first + m] + spec.offset(depth)  # (m,) what RoPE sees
    # The window counts cache slots (a window cache keeps the last W-1 entries): slot positions advance even where
    # a loop variant freezes the position RoPE sees (position_frozen).
    slots, keys = bridge_positions[first:first + m] + (depth - 1), key_positions(first, bridge_positions, counts)
    mask = within_window(chain_mask(first, len(bridge_positions), counts), slots, keys, spec.window)
    if not spec.uniform:
        stages = head.steps(rotary, embed[None], recycled[None], positions[None], mask, cache)
        return {k: v[0] for k, v in stages.items()}, None
    from oracle.attention_evidence import reused_projections

    with reused_projections(head):  # the uniform pass reuses this pass's q/k/v projections
        stages = head.steps(rotary, embed[None], recycled[None], positions[None], mask, cache)
        cache.crop(-m)  # the uniform pass appends this step's entries again (the same keys: they come from `ah`)
        attn = head.uniform_attention(rotary, stages["ah"], positions[None], mask, cache)
    return {k: v[0] for k, v in stages.items()}, attn[0]


def _recycle_alternatives(head, bridge: Bridge, previous: Stages, spec: ChainSpec, n: int, depth: Depth) -> None:
    """h_if_prenorm / h_if_main: the `h` this depth would have had, had the engine recycled the family's pre-norm
    tensor (e.g. res2) or the main model's H_i instead: the head's own hidden norm applied to that tensor."""
    if spec.prenorm is not None:
        depth.evidence["h_if_prenorm"] = head.hidden_norm(previous[spec.prenorm][:n][None])[0].numpy()
    if spec.record_main:
        depth.evidence["h_if_main"] = head.hidden_norm(bridge.hidden[:n][None])[0].numpy()


# ---------------------------------------------------------------------------------------------------------------
# the family's tables: the draft projection and the embedding rows a chain token reads


def draft_projection(ckpt: Checkpoint, chunk_rows: int = CHUNK_ROWS) -> LmHead:
    """The head's own output projection where its family names one and the checkpoint has it (DeepSeek/GLM:
    `model.layers.{N}.shared_head.head.weight`), else the main lm_head (lm_head_of), with the family's draft
    logits where it declares them (Inkling: muP-scaled, sliced to the unpadded vocabulary). CheckpointError when
    neither is there."""
    projection = _projection(ckpt, chunk_rows)
    draft_logits = getattr(ckpt.family, "draft_logits", None)
    if draft_logits is None:
        return projection
    divisor, vocab_rows = draft_logits(ckpt.config)
    return dataclasses.replace(projection, divisor=divisor, vocab_rows=vocab_rows)


def _projection(ckpt: Checkpoint, chunk_rows: int) -> LmHead:
    own = ckpt.family.lm_head.format(num_hidden_layers=getattr(ckpt.config, "num_hidden_layers", None))
    if own == LM_HEAD:
        return lm_head_of(ckpt, chunk_rows)
    if own not in ckpt.names():
        try:
            return lm_head_of(ckpt, chunk_rows)
        except CheckpointError as missing:  # name what this family reads first, not only the fallback
            raise CheckpointError(f"{ckpt.path} has no {own} (the {ckpt.family.name} head's output projection), "
                                  f"and no fallback: {missing}") from None
    entry, cfg = ckpt.entry(own), ckpt.config
    if chunk_rows < 1:
        raise InputError(f"--chunk-rows {chunk_rows}: read at least 1 lm_head row at a time (default {CHUNK_ROWS}).")
    if entry.dtype not in ("BF16", "F16", "F32") or tuple(entry.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"{own} is {entry.dtype} {list(entry.shape)}; acceptance reads a BF16/F16/F32 "
                              f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size, hidden_size) head.")
    return LmHead(ckpt, own, chunk_rows)


def embedding_rows(ckpt: Checkpoint, token_ids: np.ndarray) -> np.ndarray:
    """Embedding rows from the family's choice of table (DeepSeek/GLM: the MTP layer's own copy where present)."""
    impl = head_module(ckpt.family)
    if hasattr(impl, "embedding_rows"):
        return impl.embedding_rows(ckpt, token_ids)[0]
    return ckpt.embedding_rows(token_ids)
