"""The DeepSeek-V3 / GLM-4.5 MTP head, built on transformers' own `transformers.modeling_layers.MtpLayer`.

What it is: an official `MtpLayer` (enorm, hnorm, `eh_proj` over concat(enorm(embed), hnorm(H)), the family's
official decoder layer as `mtp_block`, `post_norm`) holding the family's `*DecoderLayer` and `*RMSNorm`, loaded
strictly with the checkpoint's `model.layers.{num_hidden_layers}.*` tensors under the names transformers' own
conversion gives them (`shared_head.norm` -> `post_norm`, layer tensors -> `mtp_block.*`). Nothing is transcribed:
every stage is recorded by a forward hook on the official module that computes it. The family's official rotary
embedding gives cos/sin. The only step outside `MtpLayer` is the optional position-0 embedding mask (an engine
convention, off by default as in transformers).
What it is not: `MtpModel` (which ties the main model's embedding and lm_head and drafts tokens); the head here
runs T teacher-forced steps in float32 with its own one-layer KV cache.

Weights: bf16 linears stay bf16 and are widened block-wise in use (torch_parts.UpcastLinear); FP8 linears stay FP8 and
are dequantized with their block scales (oracle/fp8.py) in use: the dense ones a block of rows at a time
(Fp8Linear), the routed experts only where a token routes to them, one expert at a time.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from oracle.attention_evidence import uniform_weights
from oracle.checkpoint import Checkpoint, HeadWeights
from oracle.errors import CheckpointError
from oracle.families.mtp_layer_main_model import MainLayout, run_main_model
from oracle.families.mtp_layer_main_model import load_main_model as load_main
from oracle.families.mtp_layer_layout import MtpLayerConfig, MtpLayerTensors
from oracle.families.routing_evidence import grouped_flip_distances
from oracle.families.torch_parts import (FP8_SCALE, Fp8Weights, RoutedFp8Experts, UpcastLinear,
                                         causal_mask, is_linear_weight, step_tensors, to_numpy,
                                         widen_non_linear_parameters)
from oracle.fp8 import E4M3
from oracle.qk_parts import PartVariant, kv_append_variants
from oracle.trace import TraceInputs

try:
    from transformers.modeling_layers import MtpLayer
except ImportError:  # transformers before MtpLayer: refuse, never fall back to a transcription
    MtpLayer = None

Stages = dict[str, torch.Tensor]


def require_mtp_layer() -> type:
    if MtpLayer is None:
        import transformers

        raise CheckpointError(f"transformers {transformers.__version__} has no transformers.modeling_layers.MtpLayer; "
                              f"the DeepSeek-V3/GLM-4.5 heads are built from it (transformers >= 5.24). Upgrade "
                              f"transformers; the oracle does not fall back to a transcription.")
    return MtpLayer


class MtpLayerHead(nn.Module):
    """An official MtpLayer plus the hooks that record its stages.

    forward(embed, hidden, rope, mask, cache, positions) -> {stage: (1, T, w)}. `positions` is needed only with the
    position-0 embedding mask."""

    def __init__(self, text, decoder_layer: type, rms_norm: type, mask_pos0_embedding: bool = False):
        super().__init__()
        self.text_config = text
        self.mask_pos0_embedding = mask_pos0_embedding
        # layer_idx 0 of the head's own cache; get_mtp_config sets first_k_dense_replace 0, so mtp_block is MoE
        self.layer = require_mtp_layer()(text, decoder_layer, rms_norm, layer_idx=0, use_post_norm=True)
        self._seen: Stages | None = None

    def install_hooks(self) -> None:
        """Forward hooks on the official submodules (after the linears were swapped for UpcastLinear/Fp8Linear)."""
        layer, block = self.layer, self.layer.mtp_block
        mlp = block.mlp

        def out(name, pick=lambda o: o):
            return lambda module, args, output: self._keep(name, pick(output))

        def inp(name):
            return lambda module, args: self._keep(name, args[0])

        layer.enorm.register_forward_hook(out("e"))
        layer.hnorm.register_forward_hook(out("h"))
        layer.eh_proj.register_forward_pre_hook(inp("fc_in"))
        layer.eh_proj.register_forward_hook(out("fc"))
        block.input_layernorm.register_forward_hook(out("ah"))
        block.self_attn.register_forward_hook(out("attn", lambda o: o[0]))
        block.post_attention_layernorm.register_forward_pre_hook(inp("res1"))
        block.post_attention_layernorm.register_forward_hook(out("mh"))
        mlp.gate.register_forward_hook(out("router"))  # (logits (N, E) f32, weights (N, k), ids (N, k))
        mlp.experts.register_forward_hook(out("routed"))
        mlp.shared_experts.register_forward_hook(out("shared"))
        mlp.register_forward_hook(out("mlp"))
        block.register_forward_hook(out("res2"))
        layer.post_norm.register_forward_hook(out("out"))

    def steps(self, rotary, embed: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None, cache: DynamicCache | None) -> Stages:
        """Steps (1, n, ·) at `positions` under an additive `mask` through `cache`: the call every family's head
        answers (oracle/accept.py drafts through it)."""
        return self(embed, hidden, rotary(embed, positions), mask, cache, positions)

    def hidden_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stage `h` of a hidden (1, n, D) (hnorm): what the draft loop records for a recycle it did not choose."""
        return self.layer.hnorm(hidden)

    def uniform_attention(self, rotary, ah: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                          cache: DynamicCache | None) -> torch.Tensor:
        """`attn` (1, n, D) of these `ah` rows through `cache` with uniform weights over the keys `mask` lets
        through (oracle/attention_evidence.py): the draft loop's attention evidence per depth."""
        with uniform_weights(self.text_config):
            return self.layer.mtp_block.self_attn(hidden_states=ah, position_embeddings=rotary(ah, positions),
                                                  attention_mask=mask, position_ids=positions, cache=cache)[0]

    def _keep(self, name: str, value) -> None:
        if self._seen is not None:
            self._seen[name] = value

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                positions: torch.Tensor | None = None) -> Stages:
        if self.mask_pos0_embedding:
            if positions is None:
                raise RuntimeError("mask_pos0_embedding needs the step positions")  # a caller bug
            # vLLM's convention: the embedding VECTOR at absolute position 0 is zeroed before enorm
            embed = embed.masked_fill((positions == 0)[..., None], 0.0)
        self._seen = {}
        try:
            self.layer(embed, hidden, position_embeddings=rope, attention_mask=mask, position_ids=positions,
                       cache=cache)
            seen = self._seen
        finally:
            self._seen = None
        logits, weights, ids = seen.pop("router")
        rows = lambda t: t.reshape(1, -1, t.shape[-1])  # noqa: E731  (N, w) -> (1, N, w), N = T with B = 1
        margin, limited, flips = routing_evidence(self.layer.mtp_block.mlp.gate, logits, ids)
        seen |= {"router_logits": rows(logits), "topk_weights": rows(weights), "topk_ids": rows(ids),
                 "routed": rows(seen["routed"]),
                 # evidence, not stages (oracle/trace.py EVIDENCE_DOCS; export moves them to /evidence)
                 "topk_margin": rows(margin), "router_group_limited": rows(limited), "topk_flip": rows(flips)}
        return seen


def routing_evidence(gate: nn.Module, logits: torch.Tensor,
                     ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, from the official noaux_tc router's own attributes and outputs (not a re-implementation of the
    stage: evidence about it):

    margin (N, 1), in router-logit units: a logit error below it cannot change the chosen set. The choice score is
      s = sigmoid(l) + bias, and sigmoid' <= 1/4, so an error d in every logit moves an expert's s by <= d/4 and a
      group's top-2 sum by <= d/2. The set can change only if the group choice flips (needs d >= the gap between
      the topk_group-th and the next group score) or the order inside the kept groups does (needs d >= 2x the gap
      between the k-th chosen and the best unchosen expert there).
    limited (N, 1): 1.0 where the group limit changed the choice, i.e. the plain top-k of s over ALL experts is not
      the chosen set (a group-limit error can show only at these tokens).
    flips (N, E): per expert, the same bound for that expert alone (oracle/families/routing_evidence.py); their
      minimum is the margin."""
    n, e = logits.shape
    groups, keep, k = gate.num_group, gate.topk_group, gate.top_k
    choice = logits.float().sigmoid() + gate.e_score_correction_bias
    free = torch.topk(choice, k, dim=-1).indices
    limited = torch.tensor([set(a.tolist()) != set(b.tolist()) for a, b in zip(free, ids)], dtype=torch.float32)
    group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1).values.sum(-1)  # (N, G)
    inf = torch.full((n,), float("inf"))
    ordered = torch.sort(group_scores, dim=-1, descending=True).values
    group_gap = ordered[:, keep - 1] - ordered[:, keep] if keep < groups else inf
    kept = torch.zeros(n, groups, dtype=torch.bool).scatter_(1, torch.topk(group_scores, keep, dim=-1).indices, True)
    inside = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
    top = torch.sort(inside, dim=-1, descending=True).values
    inner_gap = top[:, k - 1] - top[:, k] if k < e else inf  # -inf next (all kept experts chosen): inf
    flips = grouped_flip_distances(choice, ids, groups, keep)
    return torch.minimum(group_gap, 2 * inner_gap)[:, None], limited[:, None], flips


def _swap_linears(module: nn.Module, fp8: "Fp8Weights", fp8_linears: dict[str, str]) -> None:
    """Every nn.Linear under `module` swapped for the oracle's linear over its stored weight: FP8 weights (their
    parameter names in `fp8_linears`, -> checkpoint name) for an Fp8Linear with their block scales; bias-free bf16
    ones for an UpcastLinear; a linear with a bias (GLM's q/k/v) over a weight that is not FP8 keeps its class with
    weight and bias widened to float32 (UpcastLinear has no bias, and dropping one would run and be wrong)."""
    swapped = 0
    for path, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            key = f"{path}.{name}.weight" if path else f"{name}.weight"
            if key in fp8_linears:
                setattr(parent, name, fp8.linear(fp8_linears[key], child.bias))
                swapped += 1
            elif child.bias is None:
                setattr(parent, name, UpcastLinear(child.weight.data))
            else:
                child.weight = nn.Parameter(child.weight.data.float(), requires_grad=False)
                child.bias = nn.Parameter(child.bias.data.float(), requires_grad=False)
    if swapped != len(fp8_linears):
        raise RuntimeError(f"FP8 linears not swapped: {sorted(fp8_linears)}")  # a bug: each was loaded into one


def torch_weights(weights: HeadWeights) -> dict[str, torch.Tensor]:
    """Stored head tensors as torch tensors sharing memory: bf16 as torch.bfloat16, FP8 as its bit patterns in
    torch.uint8 (no other head tensor is uint8; dequantized with their `weight_scale_inv` in use: Fp8Linear,
    RoutedFp8Experts)."""
    as_torch = {"F32": torch.from_numpy, "F16": torch.from_numpy, E4M3: torch.from_numpy,
                "BF16": lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)}
    out = {}
    for name, arr in weights.tensors.items():
        dtype = weights.dtypes[name]
        if dtype not in as_torch:
            raise CheckpointError(f"{name} is {dtype}; this head reads F32, F16, BF16 and F8_E4M3 (with "
                                  f"weight_scale_inv).")
        out[name] = as_torch[dtype](arr)
    return out



def state_name(name: str, prefix: str) -> str:
    """Checkpoint name -> MtpLayer parameter name, as transformers' conversion_mapping renames them."""
    rest = name.removeprefix(prefix)
    if rest.startswith("shared_head.norm."):
        return "layer.post_norm." + rest.removeprefix("shared_head.norm.")
    if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
        return "layer." + rest
    return "layer.mtp_block." + rest


def build_mtp_layer_head(cfg: MtpLayerConfig, text, decoder_layer: type, rms_norm: type, rotary: type,
                         layout: MtpLayerTensors, weights: dict[str, torch.Tensor]):
    """The head with every layer tensor loaded (strict: none missing, none unused, none left at init); the
    embedding/lm_head copies are not the head's (export reads embedding rows, accept the head)."""
    fp8 = Fp8Weights(weights, cfg.weight_block_size)
    experts = RoutedFp8Experts(layout.experts, weights, fp8)
    text._attn_implementation = "eager"  # eager is not causal without our mask; batched runs pass one
    text._experts_implementation = "eager"
    with torch.device("meta"):
        head = MtpLayerHead(text, decoder_layer, rms_norm, cfg.mask_pos0_embedding)
    head.requires_grad_(False)  # FP8 bytes (uint8) are loaded into nn.Linear weights until _swap_linears
    state, fp8_linears = {}, {}
    for name, t in weights.items():
        if name in layout.copies or name.endswith(FP8_SCALE) or experts.owns(name):
            continue
        key = state_name(name, cfg.head_prefix)
        if name in fp8.fp8 and is_linear_weight(head, key):
            state[key], fp8_linears[key] = t, name  # stays FP8: an Fp8Linear dequantizes it in row blocks in use
            continue
        value = fp8.value(name)
        state[key] = value if value.dim() >= 2 else value.float()
    lazy = experts.parameter_names("layer.mtp_block.mlp.experts.")
    result = head.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - lazy
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the head's tensors do not match transformers' MtpLayer with "
                              f"{decoder_layer.__name__}: missing {sorted(missing)}, unexpected "
                              f"{sorted(result.unexpected_keys)}")
    left = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta and n not in lazy]
    if left:
        raise RuntimeError(f"parameters never loaded: {left}")  # a bug: strict loading should prevent it
    widen_non_linear_parameters(head)
    _swap_linears(head, fp8, fp8_linears)
    experts.attach(head.layer.mtp_block.mlp.experts)
    head.install_hooks()
    return head.eval(), rotary(text)  # rotary built for real: its inv_freq is computed, not loaded


# ---------------------------------------------------------------------------------------------------------------
# the declaration a family file makes


@dataclass(frozen=True)
class OfficialMtpLayer:
    """One MtpLayer family's official transformers classes and the keywords its config class takes for the
    family's attention fields; the config, head and main model every such family builds the same way."""

    config_class: type  # DeepseekV3Config, Glm4MoeConfig
    decoder_layer: type  # MtpLayer.mtp_block
    rms_norm: type
    rotary: type
    main_model: type  # the base model of --main-model
    attention_config: Callable[[MtpLayerConfig], dict]  # head config -> the config class's attention keywords
    layout: Callable  # the family's FamilySpec.layout

    def text_config(self, cfg: MtpLayerConfig, **layers):
        return self.config_class(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, hidden_act="silu",
            max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=dict(cfg.rope_parameters), moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts_per_tok=cfg.num_experts_per_tok, n_shared_experts=cfg.n_shared_experts,
            n_routed_experts=cfg.num_experts, routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
            topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob, num_nextn_predict_layers=1,
            tie_word_embeddings=False, **self.attention_config(cfg), **layers)

    def head_text_config(self, cfg: MtpLayerConfig):
        """A one-layer config as transformers' get_mtp_config makes it: first_k_dense_replace 0 (the MTP layer is
        MoE)."""
        return self.text_config(cfg, num_hidden_layers=1, first_k_dense_replace=0,
                                intermediate_size=cfg.moe_intermediate_size)

    def main_text_config(self, cfg: MtpLayerConfig, raw: dict):
        """The main model's config: the head's fields with the main stack's depth, dense-layer count and dense MLP
        width (config.json's, else transformers' defaults)."""
        main = {k: raw[k] for k in ("first_k_dense_replace", "intermediate_size") if k in raw}
        return self.text_config(cfg, num_hidden_layers=cfg.num_hidden_layers, **main)

    def load_main_model(self, checkpoint: Checkpoint):
        """The official base model over the checkpoint's layers 0..N-1 (float32), for --main-model."""
        text = self.main_text_config(checkpoint.config, checkpoint.raw_config)
        return load_official_main_model(checkpoint, self.main_model, text, self.rotary)

    def build_head(self, cfg: MtpLayerConfig, weights: dict[str, torch.Tensor]):
        return build_mtp_layer_head(cfg, self.head_text_config(cfg), self.decoder_layer, self.rms_norm, self.rotary,
                                    self.layout(cfg, set(weights)), weights)


# ---------------------------------------------------------------------------------------------------------------
# running


@torch.inference_mode()
def run_batched(head: MtpLayerHead, rotary, inputs: TraceInputs) -> dict[str, np.ndarray]:
    """All T steps as one causal pass (teacher forcing: every step's inputs are known up front)."""
    embed, hidden, positions = step_tensors(inputs)
    rope = rotary(embed, positions)
    return to_numpy(head(embed, hidden, rope, causal_mask(inputs.num_tokens), None, positions))


@torch.inference_mode()
def run_stepwise(head: MtpLayerHead, rotary, inputs: TraceInputs,
                 on_step: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """One step at a time through the head's own KV cache (MLA: the compressed latent), as an engine runs it."""
    embed, hidden, positions = step_tensors(inputs)
    cache = DynamicCache(config=head.text_config)  # the head's own cache, never a main model's
    steps = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        rope = rotary(embed[:, sl], positions[:, sl])
        steps.append(head(embed[:, sl], hidden[:, sl], rope, None, cache, positions[:, sl]))
        if on_step:
            on_step(t)
    return to_numpy({name: torch.cat([s[name] for s in steps], dim=1) for name in steps[0]})


@torch.inference_mode()
def attention_with_uniform_weights(head: MtpLayerHead, rotary, inputs: TraceInputs, ah: np.ndarray) -> np.ndarray:
    """`attn` [T, D] recomputed from the trace's own `ah` rows by the official attention module with only
    softmax(q·k) replaced by uniform weights over the visible keys (MLA included: k and v still come from the
    latent; oracle/attention_evidence.py)."""
    embed, _, positions = step_tensors(inputs)
    rope = rotary(embed, positions)
    with uniform_weights(head.text_config):
        attn = head.layer.mtp_block.self_attn(hidden_states=torch.from_numpy(ah)[None], position_embeddings=rope,
                                              attention_mask=causal_mask(inputs.num_tokens))[0]
    return attn[0].numpy()


def qk_output_projection(head: MtpLayerHead) -> nn.Module:
    """The attention module's last linear, whose output it returns as is (oracle/qk_parts.py `measure`)."""
    return head.layer.mtp_block.self_attn.o_proj


@dataclass(frozen=True)
class AttentionPass:
    """The official attention module of an MtpLayer head on the trace's own `ah` rows, for the q/k-part variants
    (oracle/qk_parts.py) of DeepSeek-V3 and GLM-4.5 (their files list which parts they have)."""

    module: nn.Module
    rope: tuple
    mask: torch.Tensor
    positions: torch.Tensor
    x: torch.Tensor

    @classmethod
    def of(cls, head: MtpLayerHead, rotary, inputs: TraceInputs, ah: np.ndarray, mask_of=None) -> "AttentionPass":
        """`mask_of(None)`: the rows' mask where they are not the trace's own causal steps (a chain's rows)."""
        embed, _, positions = step_tensors(inputs)
        mask = causal_mask(inputs.num_tokens) if mask_of is None else mask_of(None)
        return cls(head.layer.mtp_block.self_attn, rotary(embed, positions), mask,
                   positions, torch.from_numpy(np.ascontiguousarray(ah))[None])

    def run(self, rope=None, mask=None):
        """A pass returning attn [T, D], with other cos/sin or another mask where given."""
        rope = self.rope if rope is None else rope
        mask = self.mask if mask is None else mask
        return lambda: self.module(hidden_states=self.x, position_embeddings=rope, attention_mask=mask)[0][0]

    def under(self, context, *args):
        """A pass run within `context(*args)` (a norm skipped, a weight or module function swapped)."""
        def go():
            with context(*args):
                return self.run()()
        return go

    def kv_append(self) -> list[PartVariant]:
        return kv_append_variants(lambda attention_mask: self.run(mask=attention_mask), self.mask)


@torch.inference_mode()
def official_layer_stepwise(head: MtpLayerHead, rotary, inputs: TraceInputs, fc: np.ndarray) -> np.ndarray:
    """res2 [T, D] as the official decoder layer (MtpLayer.mtp_block) computes it from the `fc` rows, one step at a
    time through a DynamicCache, outside the hooks' head forward (the family contract test)."""
    embed, _, positions = step_tensors(inputs)
    x = torch.from_numpy(np.ascontiguousarray(fc))[None]
    cache = DynamicCache(config=head.text_config)
    rows = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        rows.append(head.layer.mtp_block(x[:, sl], position_embeddings=rotary(embed[:, sl], positions[:, sl]),
                                         attention_mask=None, position_ids=positions[:, sl], cache=cache)[0])
    return torch.cat(rows).numpy()


def embedding_rows(ckpt: Checkpoint, token_ids: np.ndarray) -> tuple[np.ndarray, dict]:
    """Embedding rows [T, D] float32 from the MTP layer's own `embed_tokens` where the checkpoint has one, else the
    main model's; and what was used: {"tensor", "main", "rows_equal_main"} (rows compared for these tokens)."""
    cfg = ckpt.config
    own = cfg.head_prefix + "embed_tokens.weight"
    main = "model.embed_tokens.weight"
    names = set(ckpt.names())
    if own not in names:
        return ckpt.embedding_rows(token_ids), {"tensor": main, "own_copy": None}
    unique, inverse = np.unique(token_ids, return_inverse=True)
    rows = np.stack([ckpt.read_rows(own, int(t), int(t) + 1)[0] for t in unique])[inverse.reshape(-1)]
    info = {"tensor": own, "own_copy": own, "main": main if main in names else None}
    if main in names:
        info["rows_equal_main"] = bool(np.array_equal(rows, ckpt.embedding_rows(token_ids)))
    return rows, info


def main_layout(cfg: MtpLayerConfig) -> MainLayout:
    """The HF layout both families release: `model.layers.0..N-1.*`, `model.embed_tokens`, `model.norm` (layer N
    is the MTP layer), per-expert tensors, FP8 `weight_scale_inv`."""
    head = cfg.head_prefix
    return MainLayout(
        model_type=cfg.family, is_main=lambda n: n.startswith("model.") and not n.startswith(head), strip="model.",
        scale_of=lambda n: n.removesuffix("weight") + FP8_SCALE,
        expert_name=lambda stem, e, part: f"model.{stem}.{e}.{part}_proj.weight")


def load_official_main_model(checkpoint: Checkpoint, model_class: type, config, rotary_class: type):
    """The main model (DeepseekV3Model / Glm4MoeModel, float32) from layers 0..N-1 (oracle/families/
    mtp_layer_main_model.py)."""
    return load_main(checkpoint, model_class, config, main_layout(checkpoint.config), rotary_class)


def main_model_hidden(model, sequence: np.ndarray) -> np.ndarray:
    """H [T, D]: the main model's final hidden state AFTER its final norm (`last_hidden_state`), the tensor the MTP
    layer reads: vLLM's DeepseekV2Model.forward (deepseek_mtp's target) and Glm4MoeModel.forward end with
    `self.norm(hidden_states, residual)`, and transformers' MTP candidate generator feeds
    `outputs.hidden_states[-1]`, which it ties to `last_hidden_state` (shared/reference/mtp_wiring.md §2.1)."""
    return run_main_model(model, sequence)[0].float().numpy()


__all__ = ["AttentionPass", "MtpLayerHead", "OfficialMtpLayer", "attention_with_uniform_weights",
           "build_mtp_layer_head", "causal_mask", "embedding_rows", "load_official_main_model", "main_layout",
           "main_model_hidden", "official_layer_stepwise", "qk_output_projection", "run_batched", "run_stepwise",
           "torch_weights"]
