"""The draft loop's known engine bugs, reproduced by the oracle for `mtp-probe --explain` (issue 24), for every family.

A loop variant is the reference's own draft loop (oracle/draft_loop.py: `bridge_pass`, then `run_chains` with the
reference's recorded ChainSpec) with ONE change, and yields every depth's stages {depth: {stage: rows}} (depth 1
the bridge step, with its `draft`), which the probe compares with a candidate's captured depths by its own row rule:

- recycle_prenorm       ChainSpec.recycle = the family's pre-norm tensor (FamilySpec.recycle_prenorm, e.g. res2):
                        vLLM 0.33.0's GLM-4.5 MTP recycles its un-normed residual. Shows at depth 2 `h`.
- recycle_main_hidden   ChainSpec.recycle_main: every depth reads the main model's H_i again. Depth 2 `h`.
- position_frozen       ChainSpec.position_step = 0: every depth at its bridge's position p_i. Depth 2 `attn`.
- layer0_reused         layer 0 at every depth (vLLM's proposer without spec_step_idx, vllm#52688), N-layer heads
                        only, in two forms (`rows` gives both; the probe names the variant where either
                        reproduces the candidate, and says which): "one cache" (ChainSpec.one_cache: layer 0 and
                        its one cache, the chain's entries dropped at the next bridge, as vLLM's KV slots are
                        overwritten; not for conv-state heads) and "per-depth caches" (ChainSpec.layers = 0: layer
                        0's weights, each depth its own cache, as an engine that loads layer 0 into every layer).
                        Depth 2 from the first stage a layer owns (MtpModel heads: e, their enorm is per layer;
                        Qwen's shared stem: ah).
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

- layer_caches_swapped   N-layer heads: depths 2 and 3 read each other's layer's KV entries (each writes its own):
                        row s of depth 2 attends over layer 2's entries of rows r < s and its own row s, depth 3
                        over layer 1's (ChainSpec.past_kv; `swapped_caches_loop` reruns the loop until the
                        exchanged K/V are fixed). On step3p7_tiny and mimo_v2_flash_tiny: depth 2 `attn` bridge 1
                        (row 0 has no past rows).
- layer_caches_other_convention  N-layer argmax chains: the layers' caches under the other KV convention
                        (ChainSpec.engine_kv flipped): the engine order's own chain entries (vLLM) where the
                        reference holds MtpModel's teacher-forced rows, or the other way round. A convention, not a
                        bug: DIAGNOSIS naming it says to export with the engine's --chain-kv. Depth 2 `attn`
                        bridge 1 (row 0 sees no earlier chain).
- shared_head_shared    N-layer heads: every layer's post_norm (shared_head.norm; MiMo final_layernorm) is layer
                        0's (MtpModel drafts every depth through the one main lm_head already). On both fixtures:
                        depth 2 `out` bridge 0 (every stage up to res2 matches).

Argmax-chain references (--chain-tokens argmax): the candidate is fed the reference's recorded chain tokens, so
every variant is fed them too (`chain_tokens`, ChainSpec.fed), never its own drafts; the unchanged loop fed them
is the reference bit for bit. On an N-layer head's argmax chains recycle_main_hidden, position_frozen and
layer_caches_swapped are not reproduced (said). A variant that cannot apply to a reference (no chain recorded, a
one-layer head for the N-layer ones, a shared chain norm, conv-state layers for layer_caches_swapped, ...) is a
string saying why, never a silent pass. Nothing here judges a tolerance: the probe passes its own row rule in.
"""

from collections.abc import Callable

import numpy as np
import torch
from transformers import DynamicCache

from oracle.export import KV_ENGINE_ORDER
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
    Variant("layer_caches_swapped", "depths 2 and 3 attend over each other's layer's KV cache (each past row the "
                                    "other layer's entry, the current row its own)"),
    Variant("layer_caches_other_convention", "the N-layer head's caches hold what the other --chain-kv convention "
                                             "puts there (its chains' own entries in engine order, vLLM, vs "
                                             "transformers' teacher-forced rows): a convention, not a bug; export "
                                             "the reference with the engine's --chain-kv"),
    Variant("shared_head_shared", "every depth normalizes through layer 0's shared_head (one shared_head.norm / "
                                  "post_norm for all layers)"),
)
NAMES = tuple(v.name for v in LOOP_VARIANTS)
DESCRIPTIONS = {v.name: v.description for v in LOOP_VARIANTS}
NEEDS_CHAIN = ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept", "layer0_reused",
               "layer_caches_swapped", "shared_head_shared", "layer_caches_other_convention")
SWAPPED = (2, 3)  # layer_caches_swapped: the depths whose layers' caches are exchanged
# N-layer argmax chains: their chain rows (oracle/draft_loop.py _own_rows) have no recycle/position hooks
TEACHER_ONLY_N_LAYER = ("recycle_main_hidden", "position_frozen", "layer_caches_swapped")
NORM_PAIRS = (("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"), ("enorm.weight", "hnorm.weight"))

Rows = dict[int, dict[str, np.ndarray]]  # depth -> stage -> rows (depth 1: the bridge step)


class LoopVariants:
    """The reference's loop over its own inputs, and each variant of it.

    `weights`: the head's torch tensors as `impl.torch_weights` gives them (the head is built from them); `info`:
    the reference's chain record (None: it records depth 1 only, and only the variants that show there run);
    `chain_tokens`: {depth j: the token ids (n_j,) the reference fed at depth j} (its /chain/d{j}/inputs), which
    every variant is fed on an argmax-chain reference (a candidate is fed them too, so a variant drafting its own
    tokens would be compared on other tokens)."""

    def __init__(self, ckpt, cfg, impl, weights: dict[str, torch.Tensor], head, rotary, inputs: TraceInputs,
                 info: ChainInfo | None, chain_tokens: dict[int, np.ndarray] | None = None):
        self.ckpt, self.cfg, self.impl, self.weights = ckpt, cfg, impl, weights
        self.head, self.rotary, self.inputs, self.info = head, rotary, inputs, info
        self.chain_tokens = chain_tokens or {}
        self.family = ckpt.family
        self.window = self.family.attention_window(cfg)
        self._projection = None

    @property
    def multi_layer(self) -> bool:
        return getattr(self.head, "num_layers", 1) > 1

    def rows(self, name: str) -> "Rows | list[tuple[str, Rows]] | str":
        """Every depth's stages under variant `name` (a list of (form, rows) where the bug has several forms:
        layer0_reused), or why it does not apply to this reference."""
        why = self._not_applicable(name)
        if why:
            return why
        if name == "chain_kv_kept":
            return self.kept_kv_loop()
        if name == "draft_embed_tokens":
            return self.loop(draft=self._embedding_draft())
        if name == "enorm_hnorm_swap":
            return self.loop(head=self._swapped_head())
        if name == "shared_head_shared":
            return self.loop(head=self._one_post_norm_head())
        if name == "layer_caches_swapped":
            return self.swapped_caches_loop()
        spec = self.spec()
        if name == "layer_caches_other_convention":
            return self.loop(spec=_replace(spec, engine_kv=not spec.engine_kv))
        if name == "recycle_prenorm":
            spec = _replace(spec, recycle=self.family.recycle_prenorm)
        elif name == "recycle_main_hidden":
            spec = _replace(spec, recycle_main=True)
        elif name == "position_frozen":
            spec = _replace(spec, position_step=0)
        elif name == "layer0_reused":
            return self._layer0_forms(spec)
        return self.loop(spec=spec)

    def _layer0_forms(self, spec) -> "list[tuple[str, Rows]]":
        """layer0_reused's two forms (module docstring): (form, rows) each."""
        forms = []
        if not getattr(self.head, "conv_states", False):  # a conv-state head's cache is an MtpCache per layer
            window = self.head.window(0) if hasattr(self.head, "window") else spec.window
            forms.append(("one cache", self.loop(spec=_replace(spec, one_cache=True, window=window))))
        forms.append(("per-depth caches", self.loop(spec=_replace(spec, layers=lambda depth: 0))))
        return forms

    def _not_applicable(self, name: str) -> str | None:
        info, family = self.info, self.family
        if name in NEEDS_CHAIN and info is None:
            return "the reference records the bridge step only; export it with --chain K to check the loop"
        argmax = info is not None and info.tokens != "teacher_forced"
        if argmax and any(j not in self.chain_tokens for j in info.chain_depths):
            # A candidate is fed the reference's chain tokens (its drafts); a variant drafting its own would be
            # compared on other tokens, so it runs on the recorded ones, and cannot without them.
            return ("the reference's chain tokens are its own drafts (--chain-tokens argmax) and it records no "
                    "/chain/d{j}/inputs/token_ids to feed a variant; export it again")
        if argmax and name in TEACHER_ONLY_N_LAYER and self.multi_layer:
            return ("reproduced on teacher-forced chains only for an N-layer head (the reference's chain tokens are "
                    "its own drafts); export it teacher-forced (the default) to check it")
        if name == "recycle_prenorm":
            if family.recycle_prenorm is None:
                return f"the {family.name} head has no pre-norm tensor of the recycled width"
            if info.recycle == family.recycle_prenorm:
                return f"the reference itself recycles {info.recycle}"
        if name == "layer_caches_other_convention":
            if not self.multi_layer:
                return "a one-layer head drops each chain's entries: one convention"
            if not argmax:
                return "on teacher-forced chains both --chain-kv conventions fill the layers' caches alike"
        if name == "chain_kv_kept" and self.multi_layer:
            return "an N-layer head's layers keep their own caches (one-layer heads only)"
        if name == "layer0_reused":
            if not self.multi_layer:
                return "a one-layer head runs layer 0 at every depth by design"
            if all(layer == 0 for layer in info.layers):
                return "the reference itself runs layer 0 at every depth"
        if name in ("layer_caches_swapped", "shared_head_shared"):
            why = self._n_layer_why(name)
            if why:
                return why
        if name == "draft_embed_tokens" and self._draft() is None:
            return "the checkpoint has no draft projection (the reference has no draft stage)"
        if name == "enorm_hnorm_swap" and not _norm_pairs(self.weights):
            return "no embedding/hidden pre-norm pair among the head's tensors"
        return None

    def _n_layer_why(self, name: str) -> str | None:
        """Why an N-layer variant cannot apply (one cache or one norm for every depth by design, ...), or None."""
        info, head = self.info, self.head
        if not self.multi_layer:
            return f"a one-layer head {'has one cache' if name == 'layer_caches_swapped' else 'has one shared_head'}"
        if name == "layer_caches_swapped":
            if info.depths < SWAPPED[-1]:
                return f"the reference records depths 2..{info.depths}; export --chain 3 or more to check depth 3's"
            if info.layers[0] == info.layers[1]:
                return "the reference runs the same layer at depths 2 and 3"
            if getattr(head, "conv_states", False):
                return ("its layers keep short-convolution states along their own rows (an MtpCache): not "
                        "reproduced for such heads")
            return None
        if getattr(head, "one_final_norm", False):
            return "the head has one final norm (mtp.norm) shared by every layer by design"
        layers = getattr(getattr(head, "mtp", None), "layers", None)
        if layers is None or getattr(head.mtp, "use_shared_post_norm", False):
            return "the head has one norm shared by every layer by design (chain_hidden_post_norm)"
        if layers[0].post_norm is None:
            return "the head's layers have no post_norm (shared_head.norm): each layer's output is recycled as is"
        used = {0, *info.layers}
        if all(torch.equal(layers[k].post_norm.weight, layers[0].post_norm.weight) for k in used):
            return "the layers the reference runs have equal post_norm weights: sharing one cannot show"
        return None

    # ---- the reference's loop, parametrized ---------------------------------------------------------------------

    def spec(self):
        """The ChainSpec the reference recorded (oracle/export.py _chain_records), without its evidence; an
        argmax-chain reference's recorded tokens fed at every depth (`fed`), never the variant's own drafts."""
        from oracle.draft_loop import TEACHER, ChainSpec, chain_rows

        info, total = self.info, self.inputs.num_tokens
        if info is None:
            return None
        fed = None if info.tokens == TEACHER else (lambda j: self.chain_tokens[j])
        return ChainSpec(depths=info.depths, rows=lambda j: chain_rows(total, j), tokens=info.tokens,
                         token_ids=self.inputs.token_ids, recycle=info.recycle, window=self.window,
                         layers=lambda j: info.layers[j - 2], fed=fed, engine_kv=info.kv == KV_ENGINE_ORDER)

    def loop(self, spec=None, head=None, draft=None, caches: dict | None = None) -> Rows:
        """The oracle's own loop (oracle/draft_loop.py) under `spec` (default: the reference's) with `head` and the
        draft function `draft` (default: the family's projection): {depth: {stage: rows}}. `caches` (N-layer
        heads): filled with {depth: (keys, values)} each depth's teacher-forced pass left in its layer's cache."""
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
            if caches is not None:
                caches[depth.depth] = depth.cache_rows
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
                # teacher-forced x_{i+j}, or the argmax-chain reference's recorded token
                token = int(spec.fed(j)[i] if spec.fed is not None else spec.token_ids[i + j - 1])
                embed = embedding_rows(self.ckpt, np.array([token], dtype=np.int64))[0]
                s = step(embed, s[spec.recycle], int(inputs.positions[i]) + j - 1)
                steps[j].append(s)
        rows = {j: {name: torch.stack([r[name] for r in found]).reshape(len(found), -1).numpy()
                    for name in found[0]} for j, found in steps.items() if found}
        if draft is not None:
            for part in rows.values():
                part["draft"] = draft(part["out"])[0][:, None].astype(np.int64)
        return rows

    def swapped_caches_loop(self) -> Rows:
        """layer_caches_swapped: the loop with depth 2's pass over depth 3's layer's cache and depth 3's over depth
        2's (ChainSpec.past_kv: row s sees the other's rows r < s, then its own row s). Row s of either depth
        needs the other's rows r < s only, so the loop is rerun with the K/V the previous run left until they no
        longer change: run k makes rows 0..k-1 exact, at most n_2 + 1 runs (tiny traces: a few)."""
        a, b = SWAPPED
        spec, past, rows = self.spec(), None, None
        for _ in range(self.inputs.num_tokens + 1):
            caches: dict = {}
            rows = self.loop(spec=_replace(spec, past_kv=past), caches=caches)
            new = {a: caches.get(b), b: caches.get(a)}
            if any(v is None for v in new.values()):
                return rows  # depth 3 has no rows (T = 2): nothing to exchange
            if past is not None and all(torch.equal(new[k][0], past[k][0]) and torch.equal(new[k][1], past[k][1])
                                        for k in new):
                break
            past = new
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
        return self.ckpt.main_model_prefix() + self.family.embedding  # Inkling's release: model.llm.embed.weight

    def _swapped_head(self):
        weights = dict(self.weights)
        for a, b in _norm_pairs(self.weights):
            weights[a], weights[b] = self.weights[b], self.weights[a]
        return self.impl.build_head(self.cfg, weights)[0]


    def _one_post_norm_head(self):
        """shared_head_shared: the head with every layer's post_norm (its shared_head.norm) layer 0's. MtpModel
        drafts every depth through the one main lm_head already, so the norm is the per-layer part to share."""
        head = self.impl.build_head(self.cfg, self.weights)[0]
        first = head.mtp.layers[0].post_norm.state_dict()
        for layer in head.mtp.layers[1:]:
            layer.post_norm.load_state_dict(first)
        return head


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
