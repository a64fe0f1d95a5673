"""The Qwen stem's torch half, shared by the three Qwen-stem families (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next), each
of which declares only what differs (its official classes, its config keys) in oracle/families/qwen3_5.py,
qwen3_5_moe.py and qwen3_next.py.

What it is: `MtpHead`, built from a family's official transformers classes (`QwenClasses`: its RMSNorm, decoder
layer with gated attention and a dense MLP or sparse MoE block, rotary embedding), loaded strictly with the
checkpoint's `mtp.*` tensors. Only the wiring is transcribed, one line per stage: the stem (two norms, concat, fc),
the residual adds and the final norm, in `MtpHead.stem` and `MtpHead.tail`; a MoE block's stages are recorded by
hooks on its official submodules (`moe_capture`). Then the seam's functions every family's head module answers
(`__all__`), FP8 dequantization and lazily widened routed experts.
What it is not: a reimplementation of any operator, or an MTP module shipped by transformers (there is none:
transformers drops `mtp.*` on load). The head has its own one-layer KV cache, never a main model's. It imports no
transformers model: each family's classes come in through `QwenClasses`, so an export loads only its family's.

Step i consumes (token t_{i+1}, main-model hidden H_i, position p_i). Teacher-forced inputs are known up front,
so `run_batched` runs all T steps as one causal pass; `run_stepwise` feeds one step at a time through the cache.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache

from oracle.attention_evidence import uniform_weights
from oracle.qk_parts import (PartVariant, baseline, fused_attention, interleaved_pairs, kv_append_variants,
                             neox_cos_sin, other_norm_form, rotary_off, skipped, swapped)
from oracle.checkpoint import Checkpoint, HeadWeights
from oracle.errors import CheckpointError
from oracle.families.moe_experts import RoutedExperts
from oracle.families.qwen3_5_layout import HeadConfig, moe_layout
from oracle.families.routing_evidence import topk_flip_distances
from oracle.families.torch_parts import (Fp8Weights, RoutedFp8Experts, causal_mask, is_linear_weight, selection_margin,
                                        step_tensors, to_numpy, upcast_linears, widen_non_linear_parameters)
from oracle.fp8 import E4M3, dequantize
from oracle.text import clipped
from oracle.trace import TraceInputs

Stages = dict[str, torch.Tensor]


@dataclass(frozen=True)
class QwenClasses:
    """The official transformers classes a Qwen-stem family builds its head from."""

    text_config: type
    decoder_layer: type
    rms_norm: type
    rotary: type
    text_model: type


__all__ = ["MtpHead", "attention_with_uniform_weights", "causal_mask", "main_model_hidden", "official_layer_stepwise",
           "qk_output_projection", "qk_part_variants", "run_batched", "run_stepwise", "torch_weights"]


def stem_text_config(cfg: HeadConfig, classes: QwenClasses, **family_keys):
    """A config of the family's class for the head's N MTP layers (one for every release): each is full attention
    (an MTP layer always is), attention is eager with our mask, experts (a MoE head's) eager. `family_keys`: the
    MLP's keys (the dense `intermediate_size`, or the MoE block's) and whatever else the family's config class
    reads."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,  # never the 1e4 default
            "partial_rotary_factor": cfg.partial_rotary_factor}
    if cfg.mrope:  # Qwen3.5's text mrope (3 sections); Qwen3-Next has plain partial RoPE
        rope |= {"mrope_section": list(cfg.mrope_section), "mrope_interleaved": cfg.mrope_interleaved}
    text = classes.text_config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
        attention_bias=False, num_hidden_layers=cfg.num_mtp_layers,
        layer_types=["full_attention"] * cfg.num_mtp_layers, rope_parameters=rope,
        **family_keys)
    # Eager is not causal without a mask, so the batched pass passes an explicit one (causal_mask).
    text._attn_implementation = "eager"
    if cfg.is_moe:
        text._experts_implementation = "eager"
    return text


def moe_keys(cfg: HeadConfig) -> dict:
    """The sparse MoE block's config keys, the same in Qwen3.5-MoE's and Qwen3-Next's config classes."""
    return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}


class MtpHead(nn.Module):
    """Module names mirror the checkpoint (`mtp.` stripped), so the state dict loads strictly by name.

    The decoder layers and norms are the family's official classes (`classes`). For a MoE layer, `tail` also
    records the MoE stages its block computes, through hooks on the official router, experts, shared expert and
    shared-expert gate (`moe_capture`). N layers (mtp_num_hidden_layers, vLLM's Qwen3_5MultiTokenPredictor): one
    stem and one final norm, and `layers[l]` between them at the depth that runs layer l (oracle/draft_loop.py);
    each layer's attention writes its own index of a cache (layer_idx = l), so the layers keep their own K/V."""

    def __init__(self, text, classes: QwenClasses):
        super().__init__()
        d, eps = text.hidden_size, text.rms_norm_eps
        self.text_config = text
        self.pre_fc_norm_embedding = classes.rms_norm(d, eps=eps)
        self.pre_fc_norm_hidden = classes.rms_norm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([classes.decoder_layer(text, layer_idx=i) for i in range(text.num_hidden_layers)])
        self.norm = classes.rms_norm(d, eps=eps)
        self.num_layers = len(self.layers)
        self.one_final_norm = True  # every layer's output goes through `norm` (loop_variants: shared_head_shared)

    def window(self, layer: int = 0) -> None:
        """Keys a query of `layer` sees: every earlier one of its cache (Qwen's MTP layers are full attention)."""
        return None

    def stem(self, embed: torch.Tensor, hidden: torch.Tensor) -> Stages:
        s = {}
        # The Qwen RMSNorms scale by (1 + w) (zero-centred weights); a plain `w` norm runs and is wrong.
        s["e"] = self.pre_fc_norm_embedding(embed)
        # `hidden` is the main model's POST-final-norm H (the lm_head input), normed again by the head's own norm.
        s["h"] = self.pre_fc_norm_hidden(hidden)
        # Embedding FIRST: fc was trained on [e, h]; [h, e] has the same shape and runs.
        s["fc_in"] = torch.cat([s["e"], s["h"]], dim=-1)  # (B, T, D) x 2 -> (B, T, 2D)
        s["fc"] = self.fc(s["fc_in"])  # (B, T, 2D) -> (B, T, D)
        return s

    def tail(self, fc: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
             cache: DynamicCache | None, layer: int = 0) -> Stages:
        layer, s = self.layers[layer], {}
        s["ah"] = layer.input_layernorm(fc)
        # The official gated attention: q_proj rows are per-head [q_h | gate_h] and are split per head inside it,
        # then q_norm/k_norm (1+w), partial NeoX RoPE, GQA, and attn * sigmoid(gate) before o_proj.
        s["attn"] = layer.self_attn(s["ah"], position_embeddings=rope, attention_mask=mask, cache=cache)[0]
        s["res1"] = fc + s["attn"]
        s["mh"] = layer.post_attention_layernorm(s["res1"])
        with moe_capture(layer.mlp) as moe:  # a dense MLP records nothing
            s["mlp"] = layer.mlp(s["mh"])
        s |= moe
        s["res2"] = s["res1"] + s["mlp"]
        s["out"] = self.norm(s["res2"])
        return s

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None = None, cache: DynamicCache | None = None, layer: int = 0) -> Stages:
        stem = self.stem(embed, hidden)
        return stem | self.tail(stem["fc"], rope, mask, cache, layer)

    def steps(self, rotary, embed: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None, cache: DynamicCache | None, layer: int = 0) -> Stages:
        """Steps (1, n, ·) at `positions` under an additive `mask` through MTP layer `layer` and `cache`: the call
        every family's head answers (oracle/accept.py drafts through it)."""
        return self(embed, hidden, rotary(embed, positions), mask, cache, layer)

    def hidden_norm(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Stage `h` of a hidden (1, n, D): what the draft loop records for a recycle it did not choose (the one
        stem every layer shares: `layer` changes nothing)."""
        return self.pre_fc_norm_hidden(hidden)

    def uniform_attention(self, rotary, ah: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                          cache: DynamicCache | None, layer: int = 0) -> torch.Tensor:
        """`attn` (1, n, D) of these `ah` rows through MTP layer `layer` and `cache` with uniform weights over the
        keys `mask` lets through (oracle/attention_evidence.py): the draft loop's attention evidence per depth."""
        with uniform_weights(self.text_config):
            return self.layers[layer].self_attn(ah, position_embeddings=rotary(ah, positions), attention_mask=mask,
                                                cache=cache)[0]


FP8_SCALE = "weight_scale_inv"  # X.weight_scale_inv: the block scale beside an FP8 X.weight


def torch_weights(weights: HeadWeights) -> dict[str, torch.Tensor]:
    """Stored head tensors as torch tensors, sharing memory: bf16 bit patterns become torch.bfloat16, FP8 (F8_E4M3)
    stays its bit patterns in torch.uint8 (dequantized in build_head); FP8 block scales (small; BF16 in Qwen's
    releases) are widened to float32, exactly."""
    as_torch = {"F32": lambda a: torch.from_numpy(a), "F16": lambda a: torch.from_numpy(a),
                "BF16": lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16),
                "F8_E4M3": lambda a: torch.from_numpy(a)}
    out = {}
    for name, arr in weights.tensors.items():
        if weights.dtypes[name] not in as_torch:
            raise CheckpointError(f"{name} is {weights.dtypes[name]}; this head reads F32, F16, BF16 and F8_E4M3 "
                                  f"(with {name.removesuffix('weight')}{FP8_SCALE}).")
        out[name] = as_torch[weights.dtypes[name]](arr)
        if name.endswith(FP8_SCALE):
            out[name] = out[name].float()
    return out


def dequantize_fp8(cfg: HeadConfig, weights: dict[str, torch.Tensor], lazy: frozenset[str] = frozenset()):
    """(the head's tensors with every FP8 weight as an Fp8Linear over its bytes and block scale (dequantized in row
    blocks in use; build_qwen_head dequantizes whole one that is no linear's weight) and the scales dropped, the
    Fp8Weights or None when nothing is FP8). Tensors in `lazy` (routed experts) stay as stored:
    RoutedFp8Experts dequantizes them one expert at a time, where tokens route. An FP8 weight without its scale, or
    a scale beside a weight that is not FP8, is refused by name (oracle/families/mtp_layer.py Fp8Weights)."""
    if cfg.weight_block_size is None and not any(t.dtype == torch.uint8 for t in weights.values()):
        return weights, None  # bf16: nothing to dequantize, nothing more imported
    fp8 = Fp8Weights(weights, cfg.weight_block_size)
    return {n: fp8.linear(n) if n in fp8.fp8 and n not in lazy else t for n, t in weights.items()
            if not n.endswith(FP8_SCALE)}, fp8


def routed_experts(cfg: HeadConfig, layout, weights: dict[str, torch.Tensor]) -> tuple[RoutedExperts, dict]:
    """A MoE head's routed experts in `layout` (read only where tokens route: bf16 widened, FP8 dequantized with
    their scales, one expert at a time, as DeepSeek's are) and its other tensors, FP8 linears dequantized. Fused
    FP8 experts never get here: the layout refuses their scales, dequantize_fp8 an FP8 weight without one."""
    dense, fp8 = dequantize_fp8(cfg, weights, frozenset(layout.tensor_names()))
    if fp8 is None or layout.kind == "fused":
        return RoutedExperts(layout, weights), dense
    return RoutedFp8Experts(layout, weights, fp8), dense


def build_stem_head(cfg: HeadConfig, weights: dict[str, torch.Tensor], text, classes: QwenClasses):
    """A Qwen-stem family's head and rotary with every `mtp.*` tensor loaded (strict: none missing, none unused, none
    left at init). Dense: FP8 linears dequantized with their block scales first. MoE: the routed experts in the
    checkpoint's layout (fused or per expert), read only where tokens route (routed_experts)."""
    if not cfg.is_moe:
        return build_qwen_head(text, classes, dequantize_fp8(cfg, weights)[0])
    experts, weights = routed_experts(cfg, moe_layout(cfg, set(weights)).experts, weights)
    return build_qwen_head(text, classes, weights, experts)


def build_qwen_head(text, classes: QwenClasses, weights: dict[str, torch.Tensor], experts=None):
    """A Qwen-stem head from `classes`, loaded strictly from `weights` (checkpoint names).

    Linear weights keep their dtype (widened block-wise by UpcastLinear); norm weights become float32. `experts`
    (oracle/families/moe_experts.py), when given, supplies the routed experts' two fused parameters, widened only
    for the experts a forward pass routes to; every other parameter must come from `weights`."""
    with torch.device("meta"):  # no default init of full-size modules: every parameter must come from `weights`
        head = MtpHead(text, classes)
    head.requires_grad_(False)  # FP8 bytes (uint8) load into nn.Linear weights until upcast_linears
    fp8 = {name.removeprefix("mtp."): t for name, t in weights.items() if isinstance(t, nn.Module)}  # Fp8Linear
    state = {name.removeprefix("mtp."): t if t.dim() >= 2 else t.float() for name, t in weights.items()
             if not isinstance(t, nn.Module)}
    state |= {key: linear.weight if is_linear_weight(head, key) else linear.value() for key, linear in fp8.items()}
    lazy = experts.parameter_names("layers.0.mlp.experts.") if experts is not None else set()
    state = {k: v for k, v in state.items() if not (experts is not None and experts.owns("mtp." + k))}
    result = head.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - lazy
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the head's tensors do not match the {type(head.layers[0]).__name__} head modules: "
                              f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
    left_on_meta = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta and n not in lazy]
    if left_on_meta:
        raise RuntimeError(f"parameters never loaded: {left_on_meta}")  # a bug: strict loading should prevent it
    widen_non_linear_parameters(head)
    upcast_linears(head, {key: linear for key, linear in fp8.items() if is_linear_weight(head, key)})
    if experts is not None:
        experts.attach(head.layers[0].mlp.experts)
    rotary = classes.rotary(text)  # built for real: its inv_freq buffer is computed, not loaded
    return head.eval(), rotary


@torch.inference_mode()
def run_batched(head: MtpHead, rotary, inputs: TraceInputs) -> dict[str, np.ndarray]:
    """All T steps as one causal pass (teacher forcing: every step's inputs are known up front)."""
    embed, hidden, positions = step_tensors(inputs)
    rope = rotary(embed, positions)
    return to_numpy(head(embed, hidden, rope, causal_mask(inputs.num_tokens)))


@torch.inference_mode()
def attention_with_uniform_weights(head: MtpHead, rotary, inputs: TraceInputs,
                                   ah: np.ndarray) -> np.ndarray:
    """`attn` [T, D] recomputed from the trace's own `ah` rows with uniform weights over the visible keys (the
    official attention module, only softmax(q·k) replaced: oracle/attention_evidence.py)."""
    embed, _, positions = step_tensors(inputs)
    rope = rotary(embed, positions)
    with uniform_weights(head.text_config):
        attn = head.layers[0].self_attn(torch.from_numpy(ah)[None], position_embeddings=rope,
                                        attention_mask=causal_mask(inputs.num_tokens))[0]
    return attn[0].numpy()


def qk_output_projection(head: MtpHead, layer: int = 0) -> nn.Module:
    """MTP layer `layer`'s attention's last linear, whose output it returns as is (oracle/qk_parts.py `measure`)."""
    return head.layers[layer].self_attn.o_proj


def qk_part_variants(head: MtpHead, rotary, inputs: TraceInputs, ah: np.ndarray, mask_of=None,
                     layer: int = 0) -> list[PartVariant]:
    """The wrong variants of each q/k-path part of a Qwen gated-attention head (oracle/qk_parts.py), each one pass
    of the official attention module on the trace's own `ah` rows: RoPE (cos = 1 and sin = 0; NeoX over all head
    dims; interleaved pairs on the rotary slice), q_norm and k_norm ((1+w) norms: skipped, or scaling by w) and the
    KV append (each step's own key masked out; each step seeing only its own key). Any Qwen-stem family (3.5,
    3.5-MoE, Next): RoPE's function is swapped in the attention class's own module.
    `mask_of(window)`: the additive mask of these rows for a window (None: none), when they are not the trace's own
    causal steps (a chain's rows stacked on the bridge's, oracle/qk_parts.py chain_part_records). `layer`: the MTP
    layer whose attention runs (an N-layer head's depth j: layer j-1, oracle/qk_parts.py layer_part_records), on
    that depth's own rows and positions (`inputs`)."""
    attention = head.layers[layer].self_attn
    embed, _, positions = step_tensors(inputs)
    mask = causal_mask(inputs.num_tokens) if mask_of is None else mask_of(None)
    rope, x = rotary(embed, positions), torch.from_numpy(np.ascontiguousarray(ah))[None]
    config = head.text_config

    def run(position_embeddings=rope, attention_mask=mask):
        def go():
            with fused_attention(attention, attention_mask):
                return attention(x, position_embeddings=position_embeddings, attention_mask=attention_mask)[0][0]
        return go

    def under(context, *args):
        def go():
            with context(*args):
                return run()()
        return go

    theta, head_dim = config.rope_parameters["rope_theta"], attention.head_dim
    module = sys.modules[type(attention).__module__]
    variants = [baseline(run()), PartVariant("rope", "absent", run(rotary_off(*rope)))]  # baseline: qk_parts.measure
    if rope[0].shape[-1] < head_dim:  # partial rotary: a RoPE over the whole head is a variant
        variants.append(PartVariant("rope", "all_dims", run(neox_cos_sin(positions, theta, head_dim))))
    variants.append(PartVariant("rope", "interleaved",
                                under(swapped, module, "apply_rotary_pos_emb",
                                      interleaved_pairs(module.apply_rotary_pos_emb))))
    for part in ("q_norm", "k_norm"):
        norm = getattr(attention, part)
        variants += [PartVariant(part, "absent", under(skipped, norm)),
                     PartVariant(part, "w_not_1_plus_w", under(swapped, norm, "weight", other_norm_form(norm, True)))]
    return variants + kv_append_variants(run, mask)


@torch.inference_mode()
def run_stepwise(head: MtpHead, rotary, inputs: TraceInputs,
                 on_step: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """One step at a time through the head's own KV cache, as an engine runs it."""
    embed, hidden, positions = step_tensors(inputs)
    cache = DynamicCache(config=head.text_config)  # the head's own cache, never a main model's
    steps = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        rope = rotary(embed[:, sl], positions[:, sl])
        steps.append(head(embed[:, sl], hidden[:, sl], rope, mask=None, cache=cache))  # one query: sees all keys
        if on_step:
            on_step(t)
    return to_numpy({name: torch.cat([s[name] for s in steps], dim=1) for name in steps[0]})


def load_main_model(checkpoint: Checkpoint, classes: QwenClasses):
    """The checkpoint's main text model (the family's official text model class, float32), loaded strictly."""
    raw = checkpoint.raw_config
    text = classes.text_config(**{k: v for k, v in raw.get("text_config", raw).items()
                                  if k not in ("model_type", "quantization_config")})  # FP8 is dequantized here
    text._attn_implementation = "sdpa"
    prefix = checkpoint.main_model_prefix()
    names = [n for n in checkpoint.names() if n.startswith(prefix) and not n.startswith("model.visual.")]
    if prefix == "model.":
        names = [n for n in names if not n.startswith("model.language_model.")]
    with torch.device("meta"):
        model = classes.text_model(text)
    state = _main_model_state(checkpoint, names, prefix)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"{checkpoint.path}: the main model's tensors ({prefix}*) do not match "
                              f"{classes.text_model.__name__} (--main-model needs the whole main model): "
                              f"{clipped(str(err))}") from None
    model.rotary_emb = classes.rotary(text)
    return model.eval()


def _main_model_state(checkpoint: Checkpoint, names: list[str], prefix: str) -> dict[str, torch.Tensor]:
    """The main model's tensors in float32 by module name: FP8 weights dequantized with their block scales (the
    scales consumed), an FP8 weight without one refused (never decoded unscaled); a scale beside a weight that is
    not FP8 stays in, and the strict load refuses it."""
    present = set(names)
    block = tuple(getattr(checkpoint.config, "weight_block_size", None) or (128, 128))
    state = {}
    is_fp8 = lambda n: n in present and checkpoint.entry(n).dtype == E4M3  # noqa: E731
    for name in names:
        if name.endswith(FP8_SCALE) and is_fp8(name.removesuffix(FP8_SCALE) + "weight"):
            continue  # applied to its weight below
        entry, scale = checkpoint.entry(name), name.removesuffix("weight") + FP8_SCALE
        if entry.dtype != E4M3:
            state[name.removeprefix(prefix)] = torch.from_numpy(checkpoint.read(name))
            continue
        if scale not in present or len(entry.shape) != 2:
            why = f"its block scale {scale} is missing" if scale not in present else "only 2-D FP8 linears are read"
            raise CheckpointError(f"{checkpoint.path}: main-model tensor {name} is {E4M3} {list(entry.shape)}: {why}; "
                                  f"--main-model never decodes FP8 without its block scale.")
        stored = checkpoint.stored_rows(name, 0, entry.shape[0])[0]
        state[name.removeprefix(prefix)] = torch.from_numpy(dequantize(stored, checkpoint.read(scale), block, name))
    return state


@torch.inference_mode()
def main_model_hidden(model, sequence: np.ndarray) -> np.ndarray:
    """Post-final-norm hidden [T, D] (the lm_head input) of the main model over `sequence` at positions 0..T-1."""
    ids = torch.from_numpy(np.asarray(sequence, dtype=np.int64))[None]  # (T,) -> (1, T)
    return model(input_ids=ids, use_cache=False).last_hidden_state[0].float().numpy()


class moe_capture:
    """Records the MoE stages a sparse MoE block computes in its official forward, through forward hooks on its
    router (`gate`: logits, final top-k weights, indices), `experts` (the routed sum), `shared_expert` and
    `shared_expert_gate`. `shared` = sigmoid(gate) * shared_expert(x): the block's own expression, evaluated on
    the values it computed. A block without a router (a dense MLP) records nothing."""

    def __init__(self, block: nn.Module):
        self.block, self.stages, self.handles = block, {}, []

    def __enter__(self) -> Stages:
        if not hasattr(self.block, "gate") or not hasattr(self.block, "experts"):
            return self.stages
        seen = {}

        def keep(name):
            return lambda module, args, out: seen.__setitem__(name, out)

        for name in ("gate", "experts", "shared_expert", "shared_expert_gate"):
            self.handles.append(getattr(self.block, name).register_forward_hook(keep(name)))
        self.seen = seen
        return self.stages

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        if exc[0] is not None or not self.handles:
            return
        seen = self.seen
        logits, weights, ids = seen["gate"]  # (N, E), (N, k), (N, k), N = B*T with B = 1
        rows = lambda t: t.reshape(1, -1, t.shape[-1])  # noqa: E731  (N, w) -> (1, N, w)
        self.stages.update({
            "router_logits": rows(logits), "topk_ids": rows(ids), "topk_weights": rows(weights),
            "shared": rows(F.sigmoid(seen["shared_expert_gate"]) * seen["shared_expert"]),
            "routed": rows(seen["experts"]),
            "topk_margin": rows(selection_margin(logits, ids.shape[-1])),  # evidence, not a stage
            "topk_flip": rows(topk_flip_distances(logits, ids)),  # evidence, not a stage
        })


@torch.inference_mode()
def official_layer_stepwise(head: MtpHead, rotary, inputs: TraceInputs, fc: np.ndarray) -> np.ndarray:
    """res2 [T, D] as the official decoder layer's own forward computes it from the `fc` rows, one step at a time
    through a DynamicCache (the family contract test holds the head's transcribed tail equal to it)."""
    embed, _, positions = step_tensors(inputs)
    x = torch.from_numpy(np.ascontiguousarray(fc))[None]
    cache = DynamicCache(config=head.text_config)
    rows = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        out = head.layers[0](x[:, sl], position_embeddings=rotary(embed[:, sl], positions[:, sl]),
                             attention_mask=None, cache=cache)
        rows.append((out[0] if isinstance(out, tuple) else out)[0])
    return torch.cat(rows).numpy()
