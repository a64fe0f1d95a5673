"""The draft loop's known engine bugs, reproduced by the oracle for `mtp-probe --explain` (issue 24), for every family.

A loop variant is the reference's own draft loop (oracle/draft_loop.py: `bridge_pass`, then `run_chains` with the
reference's recorded ChainSpec) with ONE change, and yields every depth's stages {depth: {stage: rows}} (depth 1
the bridge step, with its `draft`), which the probe compares with a candidate's captured depths by its own row rule:

- recycle_prenorm       ChainSpec.recycle = the family's pre-norm tensor (FamilySpec.recycle_prenorm, e.g. res2):
                        vLLM 0.33.0's GLM-4.5 MTP recycles its un-normed residual. Shows at depth 2 `h`.
- recycle_main_hidden   ChainSpec.recycle_main: every depth reads the main model's H_i again. Depth 2 `h`.
- position_frozen       ChainSpec.position_step = 0: every depth at its bridge's position p_i. Depth 2 `attn`.
- layer0_reused         ChainSpec.layers = 0 at every depth (vLLM's proposer without spec_step_idx, vllm#52688).
                        N-layer heads only; depth 2 from its first stage (each layer has its own norms).
- draft_embed_tokens    the draft through the main embed_tokens instead of the draft projection (one llama.cpp
                        fork's token_embd): every float stage matches, the `draft` stage differs (depth 1 on).
- enorm_hnorm_swap      the head built with its embedding and hidden pre-norm weights swapped (Qwen:
                        pre_fc_norm_embedding / pre_fc_norm_hidden; DeepSeek/GLM/MtpModel/V4: enorm / hnorm, every
                        layer's). Depth 1 `e`.
- chain_kv_kept         the chain's KV rows left in the cache (llama-cpp-turboquant#306): bridge i+1 attends to
                        chain i's draft entries, chain i+1 to every earlier chain's. One-layer heads: depth 1
                        `attn` at bridge 1 (the next bridge step). This is the one variant the batched loop cannot
                        express (its bridge rows are computed before any chain, which is what makes dropping exact),
                        so `kept_kv_loop` runs the engine's order one step at a time through one DynamicCache that
                        is never cropped: bridge i, its chain, bridge i+1, with the same head.steps, positions,
                        tokens, recycling and window as the loop.

A variant that cannot apply to a reference (no chain recorded, a one-layer head for layer0_reused, chain tokens
that are the reference's own drafts, ...) is a string saying why, never a silent pass. Nothing here judges a tolerance: the probe passes its own row rule in.
"""

from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache

from oracle.families.spec import Variant
from oracle.trace import ChainInfo, TraceInputs

LOOP_VARIANTS = (
    Variant("recycle_prenorm", "draft k+1 recycles the family's pre-norm tensor (e.g. res2, the un-normed residual) "
                               "instead of the recycled stage (vLLM 0.33.0's GLM-4.5 MTP)"),
    Variant("recycle_main_hidden", "every depth reuses the main model's H_i instead of the previous depth's hidden"),
    Variant("position_frozen", "the chain position does not advance: every depth at its bridge step's position"),
    Variant("chain_kv_kept", "the chain's KV rows left in the cache: the next bridge step (and chain) attends to "
                             "stale draft entries"),
    Variant("layer0_reused", "MTP layer 0 run at every depth (vLLM's proposer without spec_step_idx, vllm#52688)"),
    Variant("draft_embed_tokens", "the draft taken through embed_tokens instead of the draft projection (lm_head)"),
    Variant("enorm_hnorm_swap", "the embedding and hidden pre-norm weights swapped (enorm <-> hnorm; Qwen: "
                                "pre_fc_norm_embedding <-> pre_fc_norm_hidden)"),
)
NAMES = tuple(v.name for v in LOOP_VARIANTS)
DESCRIPTIONS = {v.name: v.description for v in LOOP_VARIANTS}
NEEDS_CHAIN = ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept", "layer0_reused")
NORM_PAIRS = (("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"), ("enorm.weight", "hnorm.weight"))

Rows = dict[int, dict[str, np.ndarray]]  # depth -> stage -> rows (depth 1: the bridge step)


class LoopVariants:
    """The reference's loop over its own inputs, and each variant of it.

    `weights`: the head's torch tensors as `impl.torch_weights` gives them (the head is built from them); `info`:
    the reference's chain record (None: it records depth 1 only, and only the variants that show there run)."""

    def __init__(self, ckpt, cfg, impl, weights: dict[str, torch.Tensor], head, rotary, inputs: TraceInputs,
                 info: ChainInfo | None):
        self.ckpt, self.cfg, self.impl, self.weights = ckpt, cfg, impl, weights
        self.head, self.rotary, self.inputs, self.info = head, rotary, inputs, info
        self.family = ckpt.family
        self.window = self.family.attention_window(cfg)
        self._projection = None

    @property
    def multi_layer(self) -> bool:
        return getattr(self.head, "num_layers", 1) > 1

    def rows(self, name: str) -> "Rows | str":
        """Every depth's stages under variant `name`, or why it does not apply to this reference."""
        why = self._not_applicable(name)
        if why:
            return why
        if name == "chain_kv_kept":
            return self.kept_kv_loop()
        if name == "draft_embed_tokens":
            return self.loop(draft=self._embedding_draft())
        if name == "enorm_hnorm_swap":
            return self.loop(head=self._swapped_head())
        spec = self.spec()
        if name == "recycle_prenorm":
            spec = _replace(spec, recycle=self.family.recycle_prenorm)
        elif name == "recycle_main_hidden":
            spec = _replace(spec, recycle_main=True)
        elif name == "position_frozen":
            spec = _replace(spec, position_step=0)
        elif name == "layer0_reused":
            spec = _replace(spec, layers=lambda depth: 0)
        return self.loop(spec=spec)

    def _not_applicable(self, name: str) -> str | None:
        info, family = self.info, self.family
        if name in NEEDS_CHAIN and info is None:
            return "the reference records the bridge step only; export it with --chain K to check the loop"
        if info is not None and info.tokens != "teacher_forced":
            # A candidate is fed the reference's chain tokens (its drafts); a variant drafting its own would be
            # compared on other tokens. Teacher-forced tokens are the same whatever the loop computes.
            return ("the reference's chain tokens are its own drafts (--chain-tokens argmax); export it teacher-"
                    "forced (the default) to diagnose the loop")
        if name == "recycle_prenorm":
            if family.recycle_prenorm is None:
                return f"the {family.name} head has no pre-norm tensor of the recycled width"
            if info.recycle == family.recycle_prenorm:
                return f"the reference itself recycles {info.recycle}"
        if name == "chain_kv_kept" and self.multi_layer:
            return "an N-layer head's layers keep their own caches (one-layer heads only)"
        if name == "layer0_reused":
            if not self.multi_layer:
                return "a one-layer head runs layer 0 at every depth by design"
            if all(layer == 0 for layer in info.layers):
                return "the reference itself runs layer 0 at every depth"
        if name == "draft_embed_tokens" and self._draft() is None:
            return "the checkpoint has no draft projection (the reference has no draft stage)"
        if name == "enorm_hnorm_swap" and not _norm_pairs(self.weights):
            return "no embedding/hidden pre-norm pair among the head's tensors"
        return None

    # ---- the reference's loop, parametrized ---------------------------------------------------------------------

    def spec(self):
        """The ChainSpec the reference recorded (oracle/export.py _chain_records; teacher-forced tokens), without
        its evidence."""
        from oracle.draft_loop import TEACHER, ChainSpec, chain_rows

        info, total = self.info, self.inputs.num_tokens
        if info is None:
            return None
        return ChainSpec(depths=info.depths, rows=lambda j: chain_rows(total, j), tokens=TEACHER,
                         token_ids=self.inputs.token_ids, recycle=info.recycle, window=self.window,
                         layers=lambda j: info.layers[j - 2])

    def loop(self, spec=None, head=None, draft=None) -> Rows:
        """The oracle's own loop (oracle/draft_loop.py) under `spec` (default: the reference's) with `head` and the
        draft function `draft` (default: the family's projection): {depth: {stage: rows}}."""
        from oracle.draft_loop import bridge_pass, embedding_rows, run_chains

        head, spec, draft = head or self.head, spec or self.spec(), draft or self._draft()
        inputs = self.inputs
        bridge = bridge_pass(head, self.rotary, inputs.embed, inputs.hidden, inputs.positions, self.window)
        rows = {1: {name: t.numpy() for name, t in bridge.stages.items()}}
        first = None
        if draft is not None:
            first = draft(rows[1]["out"])[0]
            rows[1]["draft"] = first[:, None].astype(np.int64)
        if spec is None:
            return rows
        for depth in run_chains(head, self.rotary, bridge, spec, lambda ids: embedding_rows(self.ckpt, ids), draft,
                                first):
            rows[depth.depth] = {name: t.numpy() for name, t in depth.stages.items()}
            if depth.drafts is not None:
                rows[depth.depth]["draft"] = depth.drafts[:, None].astype(np.int64)
        return rows

    @torch.inference_mode()
    def kept_kv_loop(self) -> Rows:
        """chain_kv_kept: the engine's order (bridge i, its chain, bridge i+1) one step at a time through one cache
        that keeps every entry (see the module docstring); tokens, positions and recycling as the reference's."""
        from oracle.draft_loop import embedding_rows, within_window

        spec, inputs, draft, head = self.spec(), self.inputs, self._draft(), self.head
        cache, keys = DynamicCache(), []
        steps: dict[int, list[dict[str, torch.Tensor]]] = {j: [] for j in range(1, spec.depths + 1)}

        def step(embed: np.ndarray, hidden: torch.Tensor, position: int) -> dict[str, torch.Tensor]:
            keys.append(position)
            p, slot = torch.tensor([position]), len(keys) - 1
            # a window counts cache slots (the last W-1 entries are kept), as the loop's does (oracle/draft_loop.py)
            mask = within_window(torch.zeros(1, 1, 1, len(keys)), torch.tensor([slot]), torch.arange(len(keys)),
                                 self.window)
            e = torch.from_numpy(np.ascontiguousarray(embed, dtype=np.float32))[None, None]
            rows = head.steps(self.rotary, e, hidden.reshape(1, 1, -1), p[None], mask, cache)
            return {name: t[0, 0] for name, t in rows.items()}

        for i in range(inputs.num_tokens):
            s = step(inputs.embed[i], torch.from_numpy(inputs.hidden[i]), int(inputs.positions[i]))
            steps[1].append(s)
            for j in range(2, spec.depths + 1):
                if i >= spec.rows(j):
                    break
                token = int(spec.token_ids[i + j - 1])  # teacher-forced: x_{i+j}
                embed = embedding_rows(self.ckpt, np.array([token], dtype=np.int64))[0]
                s = step(embed, s[spec.recycle], int(inputs.positions[i]) + j - 1)
                steps[j].append(s)
        rows = {j: {name: torch.stack([r[name] for r in found]).reshape(len(found), -1).numpy()
                    for name in found[0]} for j, found in steps.items() if found}
        if draft is not None:
            for part in rows.values():
                part["draft"] = draft(part["out"])[0][:, None].astype(np.int64)
        return rows

    # ---- the tables a variant changes ---------------------------------------------------------------------------

    def _draft(self) -> Callable | None:
        """The family's draft projection's exact argmax (and margin) of `out` rows; None where it has none."""
        from oracle.draft_loop import draft_projection
        from oracle.errors import CheckpointError

        if self._projection is None:
            try:
                self._projection = draft_projection(self.ckpt)
            except CheckpointError:
                self._projection = False
        return None if self._projection is False else self._projection.argmax_margin

    def _embedding_draft(self) -> Callable:
        """argmax(out @ embed_tokens^T): the draft through the main embedding table (same screened exact argmax)."""
        from oracle.lm_head import LmHead

        return LmHead(self.ckpt, self._embedding_table()).argmax_margin

    def _embedding_table(self) -> str:
        """The main model's embedding table as the family names it (V4 release: embed.weight), the one an engine
        confusing it with the lm_head would read (not the MTP layer's own copy)."""
        if hasattr(self.impl, "embedding_rows"):
            info = self.impl.embedding_rows(self.ckpt, np.zeros(1, dtype=np.int64))[1] or {}
            if info.get("main") or info.get("tensor"):
                return info.get("main") or info["tensor"]
        return self.ckpt.main_model_prefix() + "embed_tokens.weight"

    def _swapped_head(self):
        weights = dict(self.weights)
        for a, b in _norm_pairs(self.weights):
            weights[a], weights[b] = self.weights[b], self.weights[a]
        return self.impl.build_head(self.cfg, weights)[0]


def _norm_pairs(weights: dict) -> list[tuple[str, str]]:
    """(embedding norm, hidden norm) tensor names of every layer: names that differ only in the pair's suffix."""
    pairs = []
    for name in weights:
        for e, h in NORM_PAIRS:
            if name.endswith(e) and name[:-len(e)] + h in weights:
                pairs.append((name, name[:-len(e)] + h))
    return pairs


def _replace(spec, **changes):
    import dataclasses

    return dataclasses.replace(spec, **changes)
