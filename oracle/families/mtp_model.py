"""Multi-layer MTP heads on transformers' own `transformers.modeling_layers.MtpModel` (issue 25); the torch-free
half (declarations, layout, stages) is oracle/families/mtp_model_layout.py.

What it is: the official main model class of the declared model type built on the meta device from config.json
(its config class reads sliding windows, per-layer rope and layer types), and `MtpModel(main_model, N)` over it:
N official `MtpLayer`s of the main model's decoder layer and norm classes. The checkpoint's MTP tensors are
loaded with `MtpModel.get_weight_conversions(main_model)` through transformers' own
`convert_and_load_state_dict_in_model`, strictly: anything missing but the embedding/lm_head MtpModel ties from the
main model, anything unexpected, mismatched or failing a conversion is refused. Stages are recorded by forward
hooks on the official modules of the layer that runs; nothing is transcribed. Rope comes from the main model's
official rotary class built for real on the MTP config, asked for the layer's type where the rope is per layer
(as `MtpModel.forward_layer` does); a model without one (Inkling: relative position logits) gets none.
Layers that keep short-convolution states (Inkling: k/v, attention output and MLP output convolved over the layer's
rows) run every pass through an official `MtpCache` (`new_cache`): the conv states live there, and the attention
reads its positions from it as MtpModel does (layer l's row r at r + l + 1; position ids are not read).
What it is not: MtpModel.forward (which embeds, masks through an MtpCache and drafts): the draft loop
(oracle/draft_loop.py) runs the layers itself, depth j on layer j-1, and the contract test holds the two equal.

Weights load as stored where they are all bf16 and the converters only move values (`_linears_load_as_stored`): the
plain linears then keep their bf16 weight behind torch_parts.UpcastLinear (widened a block of rows at a time in use,
bit-identical), the rest is float32. Otherwise they are widened to float32 before the load, but for the
routed experts of a sparse layer (Step-3.5/3.7's stacked `moe.{gate,up,down}_proj.weight` [E, I, D] / [E, D, I]):
those stay as stored (mapped) and are read and widened one expert at a time, only where the tokens route, by
`StackedExperts` (oracle/families/moe_experts.py's RoutedExperts machinery; bit-identical to the widened module,
tests/families/test_mtp_model_lazy_experts.py). Widened before the load, the dense parts need their float32 size in
memory.
"""

import contextlib
import copy
import dataclasses
import importlib
import re
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from oracle.attention_evidence import uniform_weights
from oracle.checkpoint import HeadWeights
from oracle.errors import CheckpointError
from oracle.families.moe_experts import RoutedExperts
from oracle.families.mtp_layer import torch_weights as _stored_torch_weights
from oracle.families.spec import ExpertLayout
from oracle.families.torch_parts import UpcastLinear, causal_mask, step_tensors, to_numpy
from oracle.qk_parts import PartVariant, swapped
from oracle.trace import TraceInputs

Stages = dict[str, torch.Tensor]
TIED = {"embed_tokens.weight", "shared_head.weight"}  # MtpModel takes these from the main model
# model type -> (modeling module, main model class, config class)
MODELS = {"step3p7": ("transformers.models.step3p7.modeling_step3p7", "Step3p7ForConditionalGeneration",
                      "transformers.models.step3p7.configuration_step3p7", "Step3p7Config"),
          "inkling": ("transformers.models.inkling.modeling_inkling", "InklingForConditionalGeneration",
                      "transformers.models.inkling.configuration_inkling", "InklingConfig")}


def official_config(cfg):
    """The official config of the declared model type from the raw config.json (read as transformers reads it)."""
    _, _, config_module, config_class = MODELS[cfg.family]
    # a deep copy: the official config class writes into the dicts it is given (InklingConfig fills text_config)
    raw = {k: copy.deepcopy(v) for k, v in cfg.text.items()
           if k not in ("model_type", "architectures", "transformers_version")}
    try:
        return getattr(importlib.import_module(config_module), config_class)(**raw)
    except (ValueError, TypeError, KeyError) as error:  # the official class refuses what config.json says
        raise CheckpointError(f"config.json: transformers' {config_class} refuses this config ({error}); the oracle "
                              f"reads a config exactly as that class does, so fix config.json until "
                              f"`{config_class}(**config)` accepts it.") from None


class MtpModelHead(nn.Module):
    """An official MtpModel plus the hooks that record the stages of the layer that runs."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.modeling_layers import MtpModel

        with torch.device("meta"):
            self.main = self.main_model(cfg)
            self.mtp = MtpModel(self.main, cfg.num_mtp_layers)
        self.cfg = cfg
        self.routed: dict[int, StackedExperts] = {}  # layer -> its lazily read routed experts (load)
        self.text_config = self.mtp.config
        self.text_config._attn_implementation = "eager"  # eager is not causal without our mask
        _eager_experts(self.mtp)
        self.num_layers = cfg.num_mtp_layers
        # short-convolution states per layer (Inkling): every pass runs through an MtpCache (see new_cache)
        self.conv_states = getattr(self.text_config, "number_of_conv_states", 0) > 0
        self._seen: Stages | None = None

    def new_cache(self, windowed: bool = False):
        """An empty cache for one pass. Conv-state layers: the official MtpCache (it holds the conv states and
        gives layer l's queries and keys MtpModel's offset, l + 1). Else a DynamicCache keeping every key (the
        mask does the window), or with `windowed` the official window cache of the config's layer types."""
        from transformers.cache_utils import MtpCache

        if self.conv_states:
            return MtpCache(config=self.text_config)
        return DynamicCache(config=self.text_config) if windowed else DynamicCache()

    def own_rows(self, *args):
        """The argmax chains' own rows at one depth (oracle/draft_loop.py _own_rows): batched over one shared
        cache, or, where the layers keep conv states, each chain apart (`chain_rows_apart`)."""
        from oracle.draft_loop import _own_rows

        return (chain_rows_apart if self.conv_states else _own_rows)(*args)

    def pass_cache(self):
        """The cache of a pass that needs none but where the layer reads its state or positions from one."""
        return self.new_cache() if self.conv_states else None

    def main_model(self, cfg) -> nn.Module:
        """The official main model class of the declared model type over its official config (a family whose
        config transformers does not read as is, e.g. mimo_v2_flash, builds its own)."""
        module, main_class, _, _ = MODELS[cfg.family]
        return getattr(importlib.import_module(module), main_class)(official_config(cfg))

    def weight_conversions(self) -> list:
        """MtpModel's own conversions of the checkpoint's MTP tensors (a family may add renamings it lacks)."""
        return self.mtp.get_weight_conversions(self.main)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """The checkpoint's MTP tensors through MtpModel's own weight conversions, strictly."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        self.routed = self.stacked_experts(weights)
        lazy_names = {n for routed in self.routed.values() for n in routed.layout.tensor_names()}
        state = {name: t for name, t in weights.items() if name not in lazy_names}
        conversions = self.weight_conversions()
        stored = _linears_load_as_stored(state, conversions)
        if stored:  # the loader casts each tensor to its parameter's dtype: the plain linears' is bf16 now
            for module in self.mtp.modules():
                if _plain_linear(module):
                    module.to(torch.bfloat16)  # on the meta device: the dtype only
        else:  # the converters stack and concatenate: everything but the lazy experts goes to them widened
            state = {name: t.float() for name, t in state.items()}
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its loading bar on stderr; the oracle reports progress itself
        try:
            info, _ = convert_and_load_state_dict_in_model(
                self.mtp, state, LoadStateDictConfig(weight_mapping=conversions, dtype=torch.float32))
        finally:
            hf_logging.enable_progress_bar()
        lazy = {n for layer in self.routed
                for n in RoutedExperts.parameter_names(f"layers.{layer}.mtp_block.mlp.experts.")}
        missing = set(info.missing_keys) - TIED - lazy
        # the per-layer vocabulary copies (shared_head.head, embed_tokens): MtpModel ignores them on load, as here
        ignored = [re.compile(p) for p in self.mtp._keys_to_ignore_on_load_unexpected]
        unexpected = {k for k in info.unexpected_keys if not any(p.search(k) for p in ignored)}
        problems = {"missing": sorted(missing), "unexpected": sorted(unexpected),
                    "mismatched": sorted(map(str, info.mismatched_keys)), "conversion errors": info.conversion_errors,
                    "errors": info.error_msgs}
        if any(problems.values()):
            hint = (" (each: MtpModel's name, the checkpoint's shape, the shape config.json builds); make config.json "
                    "describe the stored head: head counts, head_dim, widths, expert counts" if info.mismatched_keys
                    else "")
            raise CheckpointError("the head's tensors do not load into transformers' MtpModel through its own weight "
                                  "conversions: " + "; ".join(f"{k} {v}" for k, v in problems.items() if v) + hint)
        left = [n for n, t in self.mtp.named_parameters() if t.is_meta and n not in TIED | lazy]
        if left:
            raise RuntimeError(f"parameters never loaded: {left}")  # a bug: the check above should prevent it
        if stored:
            _upcast_plain_linears(self.mtp)
        for layer, routed in self.routed.items():
            routed.attach(self.mtp.layers[layer].mtp_block.mlp.experts)

    def stacked_experts(self, weights: dict[str, torch.Tensor]) -> dict[int, "StackedExperts"]:
        """layer -> StackedExperts over the layer's stored `moe.{gate,up,down}_proj.weight`, for every sparse layer
        whose official experts module reads `gate_up_proj[e]` / `down_proj[e]` (Step3p7Experts) and whose three
        tensors are stored in a float dtype (FP8 experts go to the converters as before). A layer without them
        (dense; another family's naming) is loaded as before."""
        found = {}
        for layer, module in enumerate(self.mtp.layers):
            experts = getattr(module.mtp_block.mlp, "experts", None)
            if experts is None or not all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "num_experts")):
                continue
            prefix = self.cfg.layer_prefix(layer) + "moe."
            names = {part: f"{prefix}{part}_proj.weight" for part in ("gate", "up", "down")}
            if not all(n in weights and weights[n].dtype in WIDENED for n in names.values()):
                continue
            e, inter, hidden = experts.num_experts, experts.intermediate_dim, experts.hidden_dim
            want = {"gate": (e, inter, hidden), "up": (e, inter, hidden), "down": (e, hidden, inter)}
            wrong = {names[p]: tuple(weights[names[p]].shape) for p in want
                     if tuple(weights[names[p]].shape) != want[p]}
            if wrong:
                raise CheckpointError(f"routed experts of MTP layer {layer} have the wrong shapes {wrong}; the config "
                                      f"builds {e} experts of [{inter}, {hidden}] (gate, up) and [{hidden}, {inter}] "
                                      f"(down): fix n_routed_experts / moe_intermediate_size, or the checkpoint.")
            found[layer] = StackedExperts(StackedLayout("stacked", e, inter, hidden, names), weights)
        return found

    def install_hooks(self) -> None:
        for layer in self.mtp.layers:
            self._hook_layer(layer)
        if self.mtp.use_shared_post_norm:  # Inkling-style: one norm after every layer
            self.mtp.shared_post_norm.register_forward_hook(self._out("out"))

    def _out(self, name, pick=lambda o: o):
        return lambda module, args, output: self._keep(name, pick(output))

    def _inp(self, name):
        return lambda module, args: self._keep(name, args[0])

    def _hook_layer(self, layer) -> None:
        block, mlp = layer.mtp_block, layer.mtp_block.mlp
        layer.enorm.register_forward_hook(self._out("e"))
        layer.hnorm.register_forward_hook(self._out("h"))
        layer.eh_proj.register_forward_pre_hook(self._inp("fc_in"))
        layer.eh_proj.register_forward_hook(self._out("fc"))
        block.input_layernorm.register_forward_hook(self._out("ah"))
        block.self_attn.register_forward_hook(self._out("attn", lambda o: o[0]))
        block.post_attention_layernorm.register_forward_pre_hook(self._inp("res1"))
        block.post_attention_layernorm.register_forward_hook(self._out("mh"))
        if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            mlp.gate.register_forward_hook(self._out("router"))  # (logits (N, E), weights (N, k), ids (N, k))
            mlp.experts.register_forward_hook(self._out("routed"))
            mlp.shared_experts.register_forward_hook(self._out("shared"))
        mlp.register_forward_hook(self._out("mlp"))
        block.register_forward_hook(self._out("res2"))
        if layer.post_norm is not None:
            layer.post_norm.register_forward_hook(self._out("out"))

    def _keep(self, name: str, value) -> None:
        if self._seen is not None:
            self._seen[name] = value

    def rope(self, rotary, x: torch.Tensor, positions: torch.Tensor, layer: int):
        """cos/sin as MtpModel.forward_layer asks the rotary: with the layer's type where rope is per layer; None
        where the model has no rotary (Inkling)."""
        if rotary is None:
            return None
        if self.mtp.has_per_layer_rope:
            return rotary(x, positions, layer_type=self.text_config.layer_types[layer])
        return rotary(x, positions)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention as the official module reads it (None: full attention)."""
        return getattr(self.mtp.layers[layer].mtp_block.self_attn, "sliding_window", None)

    def steps(self, rotary, embed, hidden, positions, mask, cache, layer: int = 0) -> Stages:
        """Steps (1, n, ·) of MTP layer `layer` (depth layer+1) at `positions` under `mask` through `cache`."""
        from oracle.export import quiet_kernel_fallbacks  # Inkling's convolutions: the reference path, unannounced

        self._seen = {}
        try:
            with quiet_kernel_fallbacks():
                self.mtp.layers[layer](embed, hidden, position_embeddings=self.rope(rotary, embed, positions, layer),
                                       attention_mask=mask, position_ids=positions, cache=cache)
            if self.mtp.use_shared_post_norm:
                self.mtp.shared_post_norm(self._seen["res2"])
            elif not self.mtp.use_post_norm:  # chain_hidden_post_norm false: the layer's output is recycled as is
                self._seen["out"] = self._seen["res2"]
            seen = self._seen
        finally:
            self._seen = None
        if "router" in seen:
            logits, weights, ids = seen.pop("router")
            rows = lambda t: t.reshape(1, -1, t.shape[-1])  # noqa: E731  (N, w) -> (1, N, w)
            seen |= {"router_logits": rows(logits.float()), "topk_weights": rows(weights), "topk_ids": rows(ids),
                     "routed": rows(seen["routed"]), "shared": rows(seen["shared"])}
        return seen

    def hidden_norm(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        return self.mtp.layers[layer].hnorm(hidden)

    def uniform_attention(self, rotary, ah, positions, mask, cache, layer: int = 0) -> torch.Tensor:
        with uniform_weights(self.text_config):
            return self.mtp.layers[layer].mtp_block.self_attn(
                hidden_states=ah, position_embeddings=self.rope(rotary, ah, positions, layer), attention_mask=mask,
                position_ids=positions, cache=cache)[0]


WIDENED = (torch.bfloat16, torch.float16, torch.float32)  # stored expert dtypes widened exactly (lazily)


class StackedLayout(ExpertLayout):
    """Routed experts stacked per part, as Step-3.5/3.7 store them: `gate`, `up` [E, I, D] and `down` [E, D, I]."""

    def tensor_names(self) -> list[str]:
        return [self.names[p] for p in ("gate", "up", "down")]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        e, i, d = self.num_experts, self.intermediate, self.hidden
        return {self.names["gate"]: (e, i, d), self.names["up"]: (e, i, d), self.names["down"]: (e, d, i)}


class StackedExperts(RoutedExperts):
    """RoutedExperts over stacked parts: expert e's gate/up/down are row e of each stored tensor (the official
    converter concatenates gate and up into gate_up_proj[e] = [gate[e]; up[e]], which RoutedExperts widens as
    gate rows first)."""

    def _stored_part(self, e: int, part: str) -> tuple[str | None, torch.Tensor]:
        return None, self._weights[self.layout.names[part]][e]


# transformers' conversion ops that only move stored values (split, join, reorder): exact in bf16 as in float32
MOVES_ONLY = frozenset({"Chunk", "Split", "Concatenate", "Interleave", "MergeModulelist", "SplitModulelist",
                        "Transpose", "PermuteForRope"})


def _eager_experts(mtp: nn.Module) -> None:
    """Every experts block runs the official eager forward, one expert at a time: the oracle's lazily read routed
    experts stand in per expert (`_Widened[e]`), never as one stacked tensor. Set on each layer's own config, since
    a per-layer MTP config is a copy; transformers 5.25 dispatches an unset one to grouped_mm."""
    for module in mtp.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _linears_load_as_stored(state: dict[str, torch.Tensor], conversions: list) -> bool:
    """Whether the plain linears can load as stored and be widened in use (UpcastLinear), not widened whole
    before the load. Widening 1.5 GB of Step-3.7's layers up front cost 4.5 s here, almost all of it page faults on
    the fresh float32 memory (the bytes alone: 0.3 s), and doubled the layers' memory.

    The loader casts each tensor to its parameter's dtype, so this holds where no cast to bf16 can lose a value:
    every conversion only moves values, and every matrix is bf16 or exact in bf16. A float32 vector that bf16
    cannot hold (Step-3.7's router_bias, Inkling's global_scale) is allowed: the matrix of a linear cannot come
    from it through conversions that only move values, so it lands in a float32 parameter."""
    ops = {type(op).__name__ for conv in conversions for op in (getattr(conv, "operations", None) or [])}

    def castable(t: torch.Tensor) -> bool:
        return t.dtype == torch.bfloat16 or t.dim() <= 1 or (
            t.is_floating_point() and torch.equal(t.bfloat16().to(t.dtype), t))

    return bool(state) and ops <= MOVES_ONLY and any(t.dtype == torch.bfloat16 for t in state.values()) and all(
        castable(t) for t in state.values())


def _upcast_plain_linears(module: nn.Module) -> None:
    """Each plain bf16 nn.Linear under `module` becomes an UpcastLinear on its stored weight (F.linear over the
    float32 weight, bit for bit); every other parameter was loaded float32 (its parameter's dtype)."""
    for name, child in module.named_children():
        if _plain_linear(child) and child.weight.dtype == torch.bfloat16:
            setattr(module, name, UpcastLinear(child.weight.data))
        else:
            _upcast_plain_linears(child)
    wrong = [n for n, t in module.named_parameters(recurse=False) if t.dtype != torch.float32 and not t.is_meta]
    if wrong:
        raise RuntimeError(f"parameters left in bf16 outside a plain linear: {wrong}")  # a bug, not the input's


def sliding_heads_as_stored(cfg, weights: dict[str, torch.Tensor]):
    """`cfg`, or where a sliding MTP layer's stored q_proj holds `num_sliding_attention_heads` heads, `cfg` with
    transformers' own `mtp_per_layer_config` giving that layer those heads.

    Why: a Step-3.5/3.7 config gives sliding layers their own head count (`attention_other_setting`: 96 against 64
    for full layers), and the released code and vLLM (step3p5_mtp builds each MTP layer at its own index into
    `layer_types`) build the sliding MTP layers with it. transformers 5.24's `get_mtp_config` swaps the main stack's
    `per_layer_config` for `mtp_per_layer_config`, unset in the hub config, so its MtpModel builds every MTP layer
    with num_attention_heads and the strict load refuses the release. The stored q_proj decides between the two
    builds (their row counts differ whenever the counts do); a q_proj matching neither is left to the strict load,
    which names both shapes. A config that sets `mtp_per_layer_config` itself is read as it is."""
    if cfg.family not in MODELS:  # it builds its own official config (MiMo: one SWA attention on every layer)
        return cfg
    text = official_config(cfg).get_text_config(decoder=True)
    kinds, sliding = getattr(text, "mtp_layer_types", None), getattr(text, "num_sliding_attention_heads", None)
    if (not kinds or not sliding or sliding == cfg.num_attention_heads
            or getattr(text, "mtp_per_layer_config", None) is not None):
        return cfg
    override = {}
    for layer, kind in enumerate(kinds):
        q = weights.get(cfg.layer_prefix(layer) + "self_attn.q_proj.weight")
        if kind == "sliding_attention" and q is not None and q.shape[0] == sliding * cfg.head_dim:
            override[layer] = {"num_attention_heads": sliding}
    if not override:
        return cfg
    raw = copy.deepcopy(cfg.text)
    (raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw)["mtp_per_layer_config"] = override
    return dataclasses.replace(cfg, text=raw)


def build_head(cfg, weights: dict[str, torch.Tensor], head_class: type[MtpModelHead] = MtpModelHead):
    head = head_class(sliding_heads_as_stored(cfg, weights))
    head.load(weights)
    head.install_hooks()
    official = getattr(head.main.get_decoder(), "rotary_emb", None)
    if official is None:  # relative position logits (Inkling): no rotary, as MtpModel ties none
        return head.eval(), None
    return head.eval(), type(official)(config=head.text_config)  # built for real: inv_freq computed, not loaded


def chain_rows_apart(head: MtpModelHead, rotary, layer: int, d: int, n: int, bridge, tf, teacher, previous_rows,
                     chain_drafts: np.ndarray, embedding_rows, spec):
    """`_own_rows` for conv-state layers: chain c at depth d+1 is MtpModel.forward's layer d over rows s = 0..c of
    its own sequence: the teacher-forced rows s <= c-d, then the chain's rows m = 1..d (its drafts d_m; recycled
    the teacher-forced row s for m = 1, its own previous row m-1 after), one causal pass through a fresh MtpCache.
    A conv state runs along one sequence, so the chains cannot share a batch as `_own_rows` has them do; the cost
    is quadratic in the chains (each reruns its prefix). Returns what `_own_rows` returns."""
    from oracle.draft_loop import Depth, chain_mask, within_window

    keep = {spec.recycle, *([spec.prenorm] if spec.prenorm else [])}
    rows = {name: torch.zeros(n, d, teacher[name].shape[-1]) for name in keep}
    last, came_from = [], {name: [] for name in keep}
    for c in range(n):
        t, own = max(c - d + 1, 0), [(m, c - d + m) for m in range(1, d + 1) if c - d + m >= 0]
        tokens = np.concatenate([tf.token_ids[:t], [chain_drafts[c, m - 1] for m, _ in own]]).astype(np.int64)
        recycled = {name: torch.cat([teacher[name][:t]] + [teacher[name][s][None] if m == 1 else
                                                           previous_rows[name][c, m - 2][None] for m, s in own])
                    for name in keep}
        positions = bridge.positions[:c + 1] + d
        embed = np.ascontiguousarray(embedding_rows(tokens), dtype=np.float32)
        mask = within_window(chain_mask(0, c + 1, ()), positions, positions, head.window(layer))
        stages = {k: v[0] for k, v in head.steps(rotary, torch.from_numpy(embed)[None], recycled[spec.recycle][None],
                                                 positions[None], mask, head.new_cache(), layer=layer).items()}
        for name in keep:
            rows[name][c, [m - 1 for m, _ in own]] = stages[name][t:]
            came_from[name].append(recycled[name][-1])
        uniform = (head.uniform_attention(rotary, stages["ah"][None], positions[None], mask, head.new_cache(),
                                          layer=layer)[0][-1] if spec.uniform else None)
        last.append((tokens[-1], positions[-1], embed[-1], {k: v[-1] for k, v in stages.items()}, uniform))
    stages = {k: torch.stack([x[3][k] for x in last]) for k in last[0][3]}
    record = Depth(0, np.array([x[0] for x in last]), torch.stack([x[1] for x in last]).numpy(),
                   torch.stack(came_from[spec.recycle]), np.stack([x[2] for x in last]), stages, layer_index=layer)
    if spec.uniform:
        record.evidence["attn_uniform"] = torch.stack([x[4] for x in last]).numpy()
    return record, rows, {name: torch.stack(t) for name, t in came_from.items()}


def torch_weights(weights: HeadWeights) -> dict[str, torch.Tensor]:
    return _stored_torch_weights(weights)


def layer_mask(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Additive causal mask (1, 1, n, n), keys within `window` positions (itself included) where it is set."""
    n = len(positions)
    mask = causal_mask(n)
    if window is None:
        return mask
    outside = positions[None, :] <= positions[:, None] - window
    return mask.masked_fill(outside[None, None], torch.finfo(torch.float32).min)


@torch.inference_mode()
def run_batched(head: MtpModelHead, rotary, inputs: TraceInputs) -> dict[str, np.ndarray]:
    """Depth 1 (layer 0) over all T steps as one causal pass."""
    embed, hidden, positions = step_tensors(inputs)
    return to_numpy(head.steps(rotary, embed, hidden, positions, layer_mask(positions[0], head.window(0)),
                                head.pass_cache()))


@torch.inference_mode()
def run_stepwise(head: MtpModelHead, rotary, inputs: TraceInputs,
                 on_step: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Depth 1 one step at a time through layer 0's own cache (a sliding window: the official window cache)."""
    embed, hidden, positions = step_tensors(inputs)
    cache = head.new_cache(windowed=True)
    steps = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        mask = _stepwise_mask(cache, positions[0, : t + 1], head.window(0))
        steps.append(head.steps(rotary, embed[:, sl], hidden[:, sl], positions[:, sl], mask, cache))
        if on_step:
            on_step(t)
    return to_numpy({name: torch.cat([s[name] for s in steps], dim=1) for name in steps[0]})


def _stepwise_mask(cache: DynamicCache, seen: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The last query's row over the keys the cache will hold after this step (None without a window)."""
    if window is None:
        return None
    kept = min(cache.get_seq_length(0), window - 1) + 1  # a sliding layer's cache keeps W-1 (its length: all seen)
    keys = seen[-kept:]
    blocked = keys <= seen[-1] - window
    return torch.zeros(1, kept).masked_fill(blocked[None], torch.finfo(torch.float32).min)[None, None]


@torch.inference_mode()
def attention_with_uniform_weights(head: MtpModelHead, rotary, inputs: TraceInputs, ah: np.ndarray) -> np.ndarray:
    embed, _, positions = step_tensors(inputs)
    attn = head.uniform_attention(rotary, torch.from_numpy(ah)[None], positions,
                                  layer_mask(positions[0], head.window(0)), None)
    return attn[0].numpy()


@torch.inference_mode()
def official_layer_stepwise(head: MtpModelHead, rotary, inputs: TraceInputs, fc: np.ndarray) -> np.ndarray:
    """res2 [T, D] as layer 0's official decoder layer computes it from the `fc` rows, one step at a time."""
    embed, _, positions = step_tensors(inputs)
    x = torch.from_numpy(np.ascontiguousarray(fc))[None]
    cache = head.new_cache(windowed=True)
    rows = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        mask = _stepwise_mask(cache, positions[0, : t + 1], head.window(0))
        rows.append(head.mtp.layers[0].mtp_block(x[:, sl], position_embeddings=head.rope(rotary, x[:, sl],
                                                 positions[:, sl], 0), attention_mask=mask,
                                                 position_ids=positions[:, sl], cache=cache)[0])
    return torch.cat(rows).numpy()


def load_main_model(checkpoint):
    raise CheckpointError(f"--main-model is not supported for {checkpoint.family.name} yet: dump H from an engine "
                          f"and pass --hidden.")


def main_model_hidden(model, sequence: np.ndarray) -> np.ndarray:
    raise CheckpointError("--main-model is not supported for this family yet.")


def qk_output_projection(head: MtpModelHead, layer: int = 0) -> nn.Module:
    """`layer`'s attention's last linear, whose output it returns as is (oracle/qk_parts.py `measure`)."""
    return head.mtp.layers[layer].mtp_block.self_attn.o_proj


@torch.inference_mode()
def qk_part_variants(head: MtpModelHead, rotary, inputs: TraceInputs, ah: np.ndarray,
                     mask_of=None, layer: int = 0) -> list[PartVariant]:
    """The wrong variants of each q/k-path part MTP layer `layer`'s official attention has (layer 0: depth 1; layer
    l: the chain depth that ran it, oracle/qk_parts.py layer_part_records), one pass each on that depth's own `ah`
    rows at its positions (through a fresh cache where the layer keeps conv states, as the real pass): RoPE where
    the model has a rotary (cos = 1 and sin = 0; NeoX over all head dims where the layer's rotary slice is partial;
    interleaved pairs), q_norm and k_norm where the module has them (skipped, or the other of w / 1 + w), the KV
    append, the sliding window where the layer has one (W - 1, W + 1, none) and the attention sink where it has
    sinks (absent: sink logits -inf). Each layer's own rope type,
    partial factor and window (per-layer in Step-3.7), so two layers may list different parts. A part the layer
    lacks (Inkling's rotary, a full-attention layer's window) is not listed, so it is never claimed."""
    from oracle.qk_parts import baseline, fused_attention, kv_append_variants, other_norm_form, skipped

    attention = head.mtp.layers[layer].mtp_block.self_attn
    embed, _, positions = step_tensors(inputs)
    x, window = torch.from_numpy(np.ascontiguousarray(ah))[None], head.window(layer)
    mask_of = mask_of or (lambda w: layer_mask(positions[0], w))  # a chain's rows: oracle/qk_parts.py
    rope, mask = head.rope(rotary, x, positions, layer), mask_of(window)

    fused = _sdpa_is_exchangeable(head, attention, rope)

    def run(position_embeddings=rope, attention_mask=mask):
        def go():
            with fused_attention(attention, attention_mask) if fused else contextlib.nullcontext():
                return attention(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, position_ids=positions, cache=head.pass_cache())[0][0]
        return go

    def under(context, *args):
        def go():
            with context(*args):
                return run()()
        return go

    variants = [baseline(run())]  # the unchanged rows are not projected again (oracle/qk_parts.py measure)
    variants += _rope_variants(head, attention, rope, positions, run, under, layer) if rope is not None else []
    for part in ("q_norm", "k_norm"):
        norm = getattr(attention, part, None)
        if norm is not None:
            one_plus = _one_plus(norm)
            variants += [PartVariant(part, "absent", under(skipped, norm)),
                         PartVariant(part, "w_not_1_plus_w" if one_plus else "1_plus_w_not_w",
                                     under(swapped, norm, "weight", other_norm_form(norm, one_plus)))]
    variants += kv_append_variants(lambda attention_mask: run(attention_mask=attention_mask), mask)
    if window is not None:
        n = inputs.num_tokens
        windows = {"one_less": window - 1, "one_more": window + 1, "none": None}
        variants += [PartVariant("window", name, run(attention_mask=mask_of(w)))
                     for name, w in windows.items() if w is None or (1 <= w < n + window)]
    sinks = getattr(attention, "sinks", None)  # per-head sink logits (MiMo's sliding layers): the softmax's extra key
    if isinstance(sinks, torch.Tensor):
        no_sink = nn.Parameter(torch.full_like(sinks, -torch.inf), requires_grad=False)
        variants.append(PartVariant("sink", "absent", under(swapped, attention, "sinks", no_sink)))
    return variants


# model types whose attention was checked to pass SDPA nothing it drops (transformers' sdpa_attention_forward ignores
# unknown keyword arguments: an unchecked module's sinks or bias under another name would vanish without an error)
SDPA_CHECKED = frozenset({"step3p7"})


def _sdpa_is_exchangeable(head: MtpModelHead, attention, rope) -> bool:
    """Whether the variant passes may run this attention through SDPA (oracle/qk_parts.py fused_attention): a
    checked model type (SDPA_CHECKED) whose official class supports it, and a module with nothing SDPA lacks
    (sinks: MiMo; no rotary but relative position logits: Inkling) nor a conv state read from the cache."""
    return (head.cfg.family in SDPA_CHECKED and bool(getattr(type(head.main), "_supports_sdpa", False))
            and rope is not None and not head.conv_states and getattr(attention, "sinks", None) is None)


def _rope_variants(head: MtpModelHead, attention, rope, positions, run, under, layer: int) -> list[PartVariant]:
    from oracle.qk_parts import interleaved_pairs, neox_cos_sin, rotary_off

    cos, _ = rope
    variants = [PartVariant("rope", "absent", run(rotary_off(*rope)))]
    if cos.shape[-1] < attention.head_dim:
        full = neox_cos_sin(positions, _rope_theta(head, layer), attention.head_dim)
        variants.append(PartVariant("rope", "all_dims", run(full)))
    module = importlib.import_module(type(attention).__module__)
    variants.append(PartVariant("rope", "interleaved", under(swapped, module, "apply_rotary_pos_emb",
                                                             interleaved_pairs(module.apply_rotary_pos_emb))))
    return variants


def _rope_theta(head: MtpModelHead, layer: int) -> float:
    params = head.text_config.rope_parameters
    if head.mtp.has_per_layer_rope:
        params = params[head.text_config.layer_types[layer]]
    return params["rope_theta"]


def _one_plus(norm: nn.Module) -> bool:
    """Whether the norm scales by 1 + w (Gemma-style; its weight starts at 0): probed on a unit input."""
    x = torch.ones(1, norm.weight.shape[-1])
    with swapped(norm, "weight", nn.Parameter(torch.zeros_like(norm.weight), requires_grad=False)):
        return bool(norm(x).abs().sum() > 0)
