"""The DeepSeek-V4 MTP head, rebuilt from transformers' official `DeepseekV4*` classes.

What it is: the release's `MTPBlock` (seed 002) as one line per stage around official modules: `DeepseekV4RMSNorm`
(enorm, hnorm, norm), two bias-free linears (e_proj, h_proj), one `DeepseekV4DecoderLayer` (its `attn_hc` /
`ffn_hc` `DeepseekV4HyperConnection`s, `input_layernorm`, `DeepseekV4Attention` with the per-head sinks,
`post_attention_layernorm`, `DeepseekV4SparseMoeBlock`) and the MTP's own `DeepseekV4HyperHead`, with
`DeepseekV4RotaryEmbedding`'s "main" RoPE. Transcribed: the stem (two norms, two projections, the broadcast sum),
the decoder layer's two hyper-connection mixes (`post * f(x) + comb^T @ x`, held equal to the official layer's own
forward by `official_layer_stepwise` and the family contract test) and the head (hc_head, then norm).

The decoder layer is built from a one-layer `DeepseekV4Config` whose `layer_types` is ["sliding_attention"] and
`mlp_layer_types` ["moe"]: the MTP layer's attention is a pure sliding window (no compressor, no indexer) and its
router is top-k with the selection bias. Layer 0 of the main config would silently be a compressed-attention,
hash-routed layer.

What it is not: a main model. `hidden` is the main model's last block output streams [T, hc·D] (before its hc_head
and final norm): given by the user, or (`--main-model`) hooked from the official `DeepseekV4Model` built over the
checkpoint's main layers (oracle/families/mtp_layer_main_model.py). The head keeps its own sliding-window KV cache.

Weights: the release's `mtp.0.*` names are mapped onto the official modules as transformers' conversion mapping
renames the main layers' (`NATIVE_TO_MODULE`). bf16 linears stay bf16 (widened block-wise in use,
torch_parts.UpcastLinear); FP8 e4m3 linears are dequantized with their `.scale` block scales (oracle/fp8.py; F32 or
UE8M0 scales) — the routed experts only where a token routes to them, one expert at a time.
"""

import sys
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4GroupedLinear,
                                                                  DeepseekV4HyperHead, DeepseekV4Model,
                                                                  DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding)

from oracle.attention_evidence import uniform_weights
from oracle.checkpoint import E8M0, Checkpoint, HeadWeights, _widen
from oracle.errors import CheckpointError, InputError
from oracle.families.deepseek_v4_layout import ALIASES, EMBED, HEAD_PREFIX, LM_HEAD, HeadConfig, scale_name, v4_layout
from oracle.families.moe_experts import RoutedExperts
from oracle.families.mtp_layer_main_model import MainLayout, run_main_model
from oracle.families.mtp_layer_main_model import load_main_model as load_main
from oracle.families.torch_parts import UpcastLinear, selection_margin
from oracle.families.routing_evidence import topk_flip_distances
from oracle.fp8 import E4M3, dequantize
from oracle.qk_parts import (PartVariant, angles, neox_on_trailing_slice, other_norm_form, rotary_off, skipped,
                             kv_append_variants, swapped)
from oracle.trace import TraceInputs

Stages = dict[str, torch.Tensor]

# Release name (after `mtp.0.`) -> module parameter, as transformers' conversion_mapping["deepseek_v4"] renames a
# main layer's tensors (`.attn.` -> `.self_attn.`, `attn_norm` -> `input_layernorm`, `wq_a` -> `q_a_proj`, ...).
NATIVE_TO_MODULE = {
    "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
    "attn_norm.weight": "layer.input_layernorm.weight", "ffn_norm.weight": "layer.post_attention_layernorm.weight",
    "hc_attn_fn": "layer.attn_hc.fn", "hc_attn_base": "layer.attn_hc.base", "hc_attn_scale": "layer.attn_hc.scale",
    "hc_ffn_fn": "layer.ffn_hc.fn", "hc_ffn_base": "layer.ffn_hc.base", "hc_ffn_scale": "layer.ffn_hc.scale",
    "attn.wq_a.weight": "layer.self_attn.q_a_proj.weight", "attn.q_norm.weight": "layer.self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "layer.self_attn.q_b_proj.weight", "attn.wkv.weight": "layer.self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "layer.self_attn.kv_norm.weight", "attn.wo_a.weight": "layer.self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "layer.self_attn.o_b_proj.weight", "attn.attn_sink": "layer.self_attn.sinks",
    "ffn.gate.weight": "layer.mlp.gate.weight", "ffn.gate.bias": "layer.mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "layer.mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "layer.mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "layer.mlp.shared_experts.down_proj.weight",
}
STREAM_STAGES = ("h", "h_proj", "x_in", "after_attn", "block_out")  # [.., hc, D] in the head, [T, hc·D] in a trace


def head_text_config(cfg: HeadConfig) -> DeepseekV4Config:
    """A one-layer DeepseekV4Config for the MTP layer: sliding-window attention, top-k MoE; eager attention (our
    sliding-window mask) and eager experts (read one at a time by RoutedExperts)."""
    text = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.num_experts_per_tok,
        n_routed_experts=cfg.num_experts, n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.scoring_func,
        norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        layer_types=["sliding_attention"],  # NOT the main config's layer 0 (compressed attention)
        mlp_layer_types=["moe"],  # NOT hash_moe (the main stack's first layers)
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, rms_norm_eps=cfg.rms_norm_eps, partial_rotary_factor=cfg.partial_rotary_factor,
        hidden_act="silu", tie_word_embeddings=False,
    )
    text._attn_implementation = "eager"
    text._experts_implementation = "eager"
    return text


class V4MtpHead(nn.Module):
    """Module names follow NATIVE_TO_MODULE. forward(embed (1,T,D), hidden (1,T,hc·D), rope, positions, mask, cache)
    -> {stage: (1, T, w)} plus `topk_margin` (evidence)."""

    def __init__(self, text: DeepseekV4Config, mask_pos0_embedding: bool = False):
        super().__init__()
        d, eps = text.hidden_size, text.rms_norm_eps
        self.text_config, self.hc, self.mask_pos0_embedding = text, text.hc_mult, mask_pos0_embedding
        self.enorm = DeepseekV4RMSNorm(d, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.layer = DeepseekV4DecoderLayer(text, layer_idx=0)
        self.hc_head = DeepseekV4HyperHead(text)  # the MTP's OWN hc_head_{fn,base,scale}, not the main model's
        self.norm = DeepseekV4RMSNorm(d, eps=eps)

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, rope: dict, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: DynamicCache | None = None) -> Stages:
        b, t, d = embed.shape
        streams = hidden.view(b, t, self.hc, d)  # (B, T, hc·D) -> (B, T, hc, D): stream-major, as flattened
        if self.mask_pos0_embedding:  # engine convention (vLLM): the embedding at absolute position 0 is zeroed
            embed = torch.where(positions[..., None] == 0, 0.0, embed)
        s = self.stem(embed, streams)
        s |= self.block(s["x_in"], rope, positions, mask, cache)
        s["head_collapsed"] = self.hc_head(s["block_out"])  # sigmoid-weighted sum of the streams: (B,T,hc,D) -> (B,T,D)
        s["out"] = self.norm(s["head_collapsed"])  # -> shared lm_head
        return {k: v.flatten(2) if k in STREAM_STAGES else v for k, v in s.items()}

    def steps(self, rotary: DeepseekV4RotaryEmbedding, embed: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache | None) -> Stages:
        """Steps (1, n, ·) at `positions` under an additive `mask` through `cache`: the call every family's head
        answers (oracle/accept.py drafts through it)."""
        return self(embed, hidden, _rope(rotary, embed, positions), positions, mask, cache)

    def hidden_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stage `h` (1, n, hc·D) of streams (1, n, hc·D) (hnorm per stream): what the draft loop records for a
        recycle it did not choose."""
        b, t, _ = hidden.shape
        return self.hnorm(hidden.view(b, t, self.hc, -1)).flatten(2)

    def uniform_attention(self, rotary, ah: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                          cache: DynamicCache | None) -> torch.Tensor:
        """`attn` (1, n, D) of these `ah` rows through `cache` with uniform weights over the keys `mask` lets
        through and the sink (oracle/attention_evidence.py): the draft loop's attention evidence per depth."""
        with uniform_weights(self.text_config):
            return self.layer.self_attn(ah, position_embeddings=_rope(rotary, ah, positions), position_ids=positions,
                                        attention_mask=mask, cache=cache)[0]

    def stem(self, embed: torch.Tensor, streams: torch.Tensor) -> Stages:
        s = {}
        s["e"] = self.enorm(embed)
        s["h"] = self.hnorm(streams)  # per stream: RMS over D (the last dim), never over hc·D
        s["e_proj"] = self.e_proj(s["e"])
        s["h_proj"] = self.h_proj(s["h"])  # per stream, one weight
        s["x_in"] = s["h_proj"] + s["e_proj"].unsqueeze(-2)  # (B,T,1,D) broadcast to every stream
        return s

    def block(self, x_in: torch.Tensor, rope: dict, positions: torch.Tensor, mask: torch.Tensor | None,
              cache: DynamicCache | None) -> Stages:
        """DeepseekV4DecoderLayer.forward, one line per stage (its official submodules); the mix line is the layer's
        own expression: post * f(collapsed) + comb^T @ streams (comb consumed transposed, as in transformers)."""
        layer, s, dtype = self.layer, {}, x_in.dtype  # post/comb come out in float32; the layer casts them back
        post, comb, collapsed = layer.attn_hc(x_in)  # Sinkhorn-projected comb, pre-weighted collapse (B,T,D)
        s["ah"] = layer.input_layernorm(collapsed)
        s["attn"] = layer.self_attn(s["ah"], position_embeddings=rope, position_ids=positions, attention_mask=mask,
                                    cache=cache)[0]
        s["after_attn"] = (post.to(dtype).unsqueeze(-1) * s["attn"].unsqueeze(-2)
                           + torch.matmul(comb.to(dtype).transpose(-1, -2), x_in))
        post, comb, collapsed = layer.ffn_hc(s["after_attn"])
        s["mh"] = layer.post_attention_layernorm(collapsed)
        with moe_capture(layer.mlp) as moe:
            s["mlp"] = layer.mlp(s["mh"], input_ids=None)  # top-k router: input_ids unused (no hash routing)
        s |= moe
        s["block_out"] = (post.to(dtype).unsqueeze(-1) * s["mlp"].unsqueeze(-2)
                          + torch.matmul(comb.to(dtype).transpose(-1, -2), s["after_attn"]))
        return s


class moe_capture:
    """Records the MoE stages DeepseekV4SparseMoeBlock computes in its official forward, by forward hooks on its
    router (`gate`: logits, final weights, indices), `experts` (the routed sum) and `shared_experts`; plus the
    selection margin (`topk_margin`, evidence) on the router's own selection scores (score + bias)."""

    def __init__(self, block: nn.Module):
        self.block, self.stages, self.seen, self.handles = block, {}, {}, []

    def __enter__(self) -> Stages:
        for name in ("gate", "experts", "shared_experts"):
            self.handles.append(getattr(self.block, name).register_forward_hook(
                lambda module, args, out, name=name: self.seen.__setitem__(name, out)))
        return self.stages

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        if exc[0] is not None:
            return
        gate = self.block.gate
        logits, weights, ids = self.seen["gate"]  # (N, E), (N, k), (N, k); N = B*T, B = 1
        rows = lambda x: x.reshape(1, -1, x.shape[-1])  # noqa: E731  (N, w) -> (1, N, w)
        # sqrtsoftplus/sigmoid have slope < 1, so a margin in selection-score units is at most the logit margin:
        # comparing it with the router_logits tolerance flags at least every possible rounding flip.
        choice = gate.score_fn(logits.float()) + gate.e_score_correction_bias
        self.stages.update({"router_logits": rows(logits), "topk_ids": rows(ids), "topk_weights": rows(weights),
                            "shared": rows(self.seen["shared_experts"]), "routed": rows(self.seen["experts"]),
                            "topk_margin": rows(selection_margin(choice, ids.shape[-1])),
                            "topk_flip": rows(topk_flip_distances(choice, ids))})


# ---------------------------------------------------------------------------------------------------------------
# weights


def torch_weights(weights: HeadWeights) -> dict[str, torch.Tensor]:
    """Stored head tensors as torch tensors sharing memory: bf16 as torch.bfloat16, F8_E4M3 as torch.uint8 bit
    patterns (dequantized in build_head), UE8M0 scales decoded to float32."""
    as_torch = {"F32": torch.from_numpy, "F16": torch.from_numpy, E4M3: torch.from_numpy,
                "BF16": lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16),
                E8M0: lambda a: torch.from_numpy(_widen(a, E8M0))}
    out = {}
    for name, arr in weights.tensors.items():
        dtype = weights.dtypes[name]
        if dtype not in as_torch:
            raise CheckpointError(f"{name} is {dtype}; the DeepSeek-V4 head reads F32, F16, BF16, F8_E4M3 (with a "
                                  f"`.scale` block scale, F32 or F8_E8M0).")
        out[name] = as_torch[dtype](arr)
    return out


class Fp8Weights:
    """FP8 linears dequantized with their `.scale` block scales; every FP8 weight needs a scale and every scale an
    FP8 weight."""

    def __init__(self, weights: dict[str, torch.Tensor], block: tuple[int, int] | None):
        self.weights, self.block = weights, tuple(block or (128, 128))
        self.fp8 = {n for n, t in weights.items() if t.dtype == torch.uint8}
        scales = {n for n in weights if n.endswith(".scale")}
        unscaled = sorted(n for n in self.fp8 if scale_name(n) not in scales)
        orphan = sorted(s for s in scales if s.removesuffix("scale") + "weight" not in self.fp8)
        if unscaled or orphan:
            raise CheckpointError(f"FP8 weights without a .scale {unscaled[:3]}, or a .scale beside a weight that is "
                                  f"not F8_E4M3 {orphan[:3]}: the checkpoint is inconsistent.")

    def scale(self, name: str) -> np.ndarray:
        """The float32 block scales of the FP8 weight `name` (UE8M0 ones decoded by the checkpoint reader)."""
        return np.ascontiguousarray(self.weights[scale_name(name)].float().numpy())

    def value(self, name: str) -> torch.Tensor:
        t = self.weights[name]
        if name not in self.fp8:
            return t
        scale = self.weights[scale_name(name)].float().numpy()
        return torch.from_numpy(dequantize(t.numpy(), scale, self.block, name))


class RoutedV4Experts(RoutedExperts):
    """Routed experts (w1 gate, w3 up, w2 down) widened or dequantized one at a time, only where tokens route."""

    def __init__(self, layout, weights: dict, fp8: Fp8Weights):
        super().__init__(layout, weights, fp8)


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]) -> tuple[V4MtpHead, DeepseekV4RotaryEmbedding]:
    """The head with every `mtp.0.*` tensor loaded (strict: none missing, none unused, none left at init)."""
    if not cfg.norm_topk_prob:
        raise InputError("norm_topk_prob false: transformers' DeepseekV4TopKRouter always renormalises the top-k "
                         "weights, and this oracle does not transcribe a router; export without --no-norm-topk-prob.")
    text = head_text_config(cfg)
    layout = v4_layout(cfg, set(weights))
    fp8 = Fp8Weights(weights, cfg.weight_block_size)
    experts = RoutedV4Experts(layout.experts, weights, fp8)
    with torch.device("meta"):  # every parameter must come from `weights`
        head = V4MtpHead(text, cfg.mask_pos0_embedding)
    state = {}
    for name in weights:
        if name in (layout.copies or {}) or name.endswith(".scale") or experts.owns(name):
            continue
        rest = name.removeprefix(HEAD_PREFIX)
        if rest not in NATIVE_TO_MODULE:
            raise CheckpointError(f"{name} is not a DeepSeek-V4 MTP tensor this oracle knows.")
        value = fp8.value(name)
        state[NATIVE_TO_MODULE[rest]] = value if value.dim() >= 2 else value.float()
    lazy = RoutedExperts.parameter_names("layer.mlp.experts.")
    result = head.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - lazy
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the head's tensors do not match the DeepseekV4 MTP modules: missing "
                              f"{sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
    left = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta and n not in lazy]
    if left:
        raise RuntimeError(f"parameters never loaded: {left}")  # a bug: strict loading should prevent it
    _widen_and_upcast(head)
    experts.attach(head.layer.mlp.experts)
    return head.eval(), DeepseekV4RotaryEmbedding(text)  # rotary built for real: inv_freq computed, not loaded


def _widen_and_upcast(module: nn.Module) -> None:
    """Plain bias-free nn.Linear -> UpcastLinear on its stored weight (widened block-wise in use); every other
    parameter (norms, hyper-connections, sinks, router, the grouped o_a_proj whose forward views its weight) and
    buffer becomes float32 (exact from bf16)."""
    for name, child in module.named_children():
        if type(child) is nn.Linear and child.bias is None:
            setattr(module, name, UpcastLinear(child.weight.data))
            continue
        for pname, param in child.named_parameters(recurse=False):
            if not param.is_meta and param.dtype != torch.float32:
                setattr(child, pname, nn.Parameter(param.float(), requires_grad=False))
        for bname, buf in child.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(child, bname, buf.float())
        if not isinstance(child, DeepseekV4GroupedLinear):
            _widen_and_upcast(child)
    for pname, param in module.named_parameters(recurse=False):
        if not param.is_meta and param.dtype != torch.float32:
            setattr(module, pname, nn.Parameter(param.float(), requires_grad=False))


# ---------------------------------------------------------------------------------------------------------------
# running


def sliding_mask(num_steps: int, window: int) -> torch.Tensor:
    """Additive mask (1, 1, T, T): step i attends to steps i-W+1 .. i of the head's own KV (W keys, itself
    included), as transformers' sliding-window mask and the DynamicSlidingWindowLayer cache (W-1 kept) do."""
    i = torch.arange(num_steps)[:, None]
    j = torch.arange(num_steps)[None, :]
    blocked = (j > i) | (j <= i - window)
    return torch.zeros(num_steps, num_steps).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


def step_tensors(inputs: TraceInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embed = torch.from_numpy(np.ascontiguousarray(inputs.embed))[None]  # (T, D) -> (1, T, D)
    hidden = torch.from_numpy(np.ascontiguousarray(inputs.hidden))[None]  # (T, hc·D) -> (1, T, hc·D)
    positions = torch.from_numpy(inputs.positions)[None]  # (T,) -> (1, T)
    return embed, hidden, positions


def _rope(rotary: DeepseekV4RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> dict:
    return {"main": rotary(x, positions, layer_type="main")}  # sliding-window layers use the "main" RoPE


def to_numpy(stages: Stages) -> dict[str, np.ndarray]:
    return {name: rows[0].numpy() for name, rows in stages.items()}  # (1, T, w) -> (T, w)


@torch.inference_mode()
def run_batched(head: V4MtpHead, rotary, inputs: TraceInputs) -> dict[str, np.ndarray]:
    """All T steps as one pass under the sliding-window causal mask (teacher forcing)."""
    embed, hidden, positions = step_tensors(inputs)
    mask = sliding_mask(inputs.num_tokens, head.text_config.sliding_window)
    return to_numpy(head(embed, hidden, _rope(rotary, embed, positions), positions, mask))


@torch.inference_mode()
def run_stepwise(head: V4MtpHead, rotary, inputs: TraceInputs,
                 on_step: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """One step at a time through the head's own sliding-window cache (keeps W-1 keys), as an engine runs it."""
    embed, hidden, positions = step_tensors(inputs)
    cache = DynamicCache(config=head.text_config)
    steps = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        steps.append(head(embed[:, sl], hidden[:, sl], _rope(rotary, embed[:, sl], positions[:, sl]),
                          positions[:, sl], None, cache))
        if on_step:
            on_step(t)
    return to_numpy({name: torch.cat([s[name] for s in steps], dim=1) for name in steps[0]})


@torch.inference_mode()
def attention_with_uniform_weights(head: V4MtpHead, rotary, inputs: TraceInputs, ah: np.ndarray) -> np.ndarray:
    """`attn` [T, D] recomputed from the trace's own `ah` rows by the official attention module with softmax(q·k)
    replaced by uniform weights over the visible keys AND the sink (oracle/attention_evidence.py): each of the n
    keys inside the window gets 1/(n+1)."""
    embed, _, positions = step_tensors(inputs)
    mask = sliding_mask(inputs.num_tokens, head.text_config.sliding_window)
    with uniform_weights(head.text_config):
        attn = head.layer.self_attn(torch.from_numpy(np.ascontiguousarray(ah))[None],
                                    position_embeddings=_rope(rotary, embed, positions), position_ids=positions,
                                    attention_mask=mask)[0]
    return attn[0].numpy()


def qk_output_projection(head: V4MtpHead) -> nn.Module:
    """The attention module's last linear (o_b_proj after the grouped o_a_proj), whose output it returns as is
    (oracle/qk_parts.py `measure`)."""
    return head.layer.self_attn.o_b_proj


def qk_part_variants(head: V4MtpHead, rotary, inputs: TraceInputs, ah: np.ndarray, mask_of=None) -> list[PartVariant]:
    """The wrong variants of each q/k-path part of the official DeepseekV4Attention (oracle/qk_parts.py), one pass
    each on the trace's own `ah` rows: RoPE (cos = 1 and sin = 0; over all head dims instead of the trailing rope
    slice; the slice as NeoX halves instead of V4's layout: the module's own RoPE function swapped, built on its own
    rotate_half, so the output's de-rotation changes with it), q_norm (the unweighted q_b_norm: skipped), k_norm
    (kv_norm, which also norms the values, K = V: skipped, or scaling by 1 + w), the KV append (own key masked out;
    only the own key), the sliding window (W - 1,
    W + 1, none: the module attends what the mask lets through) and the sink (absent: its logit -inf).
    `mask_of(window)`: the additive mask of these rows for a window (None: none), when they are not the trace's own
    causal steps (a chain's rows stacked on the bridge's, oracle/qk_parts.py chain_part_records)."""
    attention = head.layer.self_attn
    embed, _, positions = step_tensors(inputs)
    config, num_tokens = head.text_config, inputs.num_tokens
    rope, window = _rope(rotary, embed, positions), config.sliding_window
    mask_of = mask_of or (lambda w: sliding_mask(num_tokens, num_tokens + 1 if w is None else w))
    mask, x = mask_of(window), torch.from_numpy(np.ascontiguousarray(ah))[None]

    def run(position_embeddings=rope, attention_mask=mask):
        return lambda: attention(x, position_embeddings=position_embeddings, position_ids=positions,
                                 attention_mask=attention_mask)[0][0]

    def under(context, *args):
        def go():
            with context(*args):
                return run()()
        return go

    cos, sin = rope["main"]
    module = sys.modules[type(attention).__module__]
    variants = [PartVariant("rope", "absent", run({"main": rotary_off(cos, sin)}))]
    if 2 * cos.shape[-1] < attention.head_dim:
        full = angles(positions, config.rope_theta, attention.head_dim)
        variants.append(PartVariant("rope", "all_dims", run({"main": (full.cos(), full.sin())})))
    variants += [
        PartVariant("rope", "neox_halves", under(swapped, module, "apply_rotary_pos_emb",
                                                      neox_on_trailing_slice(module.rotate_half))),
        PartVariant("q_norm", "absent", under(skipped, attention.q_b_norm)),
        PartVariant("k_norm", "absent", under(skipped, attention.kv_norm)),
        PartVariant("k_norm", "1_plus_w_not_w",
                    under(swapped, attention.kv_norm, "weight", other_norm_form(attention.kv_norm, False))),
    ] + kv_append_variants(run, mask)
    windows = {"one_less": window - 1, "one_more": window + 1, "none": None}
    variants += [PartVariant("window", name, run(attention_mask=mask_of(w)))
                 for name, w in windows.items() if w is None or w >= 1]
    no_sink = nn.Parameter(torch.full_like(attention.sinks, -torch.inf), requires_grad=False)
    return variants + [PartVariant("sink", "absent", under(swapped, attention, "sinks", no_sink))]


@torch.inference_mode()
def official_layer_stepwise(head: V4MtpHead, rotary, inputs: TraceInputs, x_in: np.ndarray) -> np.ndarray:
    """block_out [T, hc·D] as the official DeepseekV4DecoderLayer's own forward computes it from the `x_in` rows,
    one step at a time through its sliding-window cache (the family contract test holds the transcribed block equal
    to it)."""
    embed, _, positions = step_tensors(inputs)
    d = head.text_config.hidden_size
    x = torch.from_numpy(np.ascontiguousarray(x_in)).view(1, -1, head.hc, d)
    cache = DynamicCache(config=head.text_config)
    rows = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        out = head.layer(x[:, sl], input_ids=None, position_embeddings=_rope(rotary, embed[:, sl], positions[:, sl]),
                         position_ids=positions[:, sl], attention_mask=None, cache=cache)
        rows.append(out[0].flatten(1))
    return torch.cat(rows).numpy()


def embedding_rows(ckpt: Checkpoint, token_ids: np.ndarray) -> tuple[np.ndarray, dict]:
    """Embedding rows [T, D] float32 from the shared table (`embed.weight`; `model.embed_tokens.weight` in a
    converted checkpoint), or the MTP layer's own copy (`mtp.0.emb.tok_emb.weight`) where present; and which."""
    names = set(ckpt.names())
    own = HEAD_PREFIX + "emb.tok_emb.weight"
    main = next((n for n in (EMBED, "model.embed_tokens.weight") if n in names), None)
    table = own if own in names else main
    if table is None:
        raise CheckpointError(f"{ckpt.path}: no embedding table; looked for {EMBED}, model.embed_tokens.weight and "
                              f"{own}.")
    shape = ckpt.entry(table).shape
    if tuple(shape) != (ckpt.config.vocab_size, ckpt.config.hidden_size):
        raise CheckpointError(f"{table} has shape {list(shape)}; config.json implies "
                              f"[{ckpt.config.vocab_size}, {ckpt.config.hidden_size}].")
    unique, inverse = np.unique(token_ids, return_inverse=True)
    rows = np.stack([ckpt.read_rows(table, int(t), int(t) + 1)[0] for t in unique])[inverse.reshape(-1)]
    info = {"tensor": table, "own_copy": own if own in names else None, "main": main}
    if own in names and main is not None:
        main_rows = np.stack([ckpt.read_rows(main, int(t), int(t) + 1)[0] for t in unique])[inverse.reshape(-1)]
        info["rows_equal_main"] = bool(np.array_equal(rows, main_rows))
    return rows, info


def main_layout() -> MainLayout:
    """The release's main model: `embed.weight`, `layers.0..N-1.*`, `norm.weight`, `hc_head_*` (the MTP layer is
    `mtp.*`, the lm_head `head.weight`), per-expert `ffn.experts.{e}.w{1,2,3}`, FP8 `.scale`."""
    experts = {"gate": "w1", "up": "w3", "down": "w2"}
    return MainLayout(
        model_type="deepseek_v4", is_main=lambda n: not n.startswith("mtp.") and n not in (LM_HEAD, "lm_head.weight"),
        strip="", scale_of=scale_name,
        expert_name=lambda stem, e, part: f"{stem.replace('.mlp.', '.ffn.')}.{e}.{experts[part]}.weight")


def main_text_config(checkpoint: Checkpoint) -> DeepseekV4Config:
    """config.json as transformers' DeepseekV4Config reads it (the release's key names taken as transformers'; its
    legacy `compress_ratios` / `num_hash_layers` give the main layers' attention and MLP types); FP8 is dequantized
    here, so the quantization config is left out."""
    aliases = {old: new for new, olds in ALIASES.items() for old in olds}
    raw = {aliases.get(k, k): v for k, v in checkpoint.raw_config.items()
           if not k.startswith("_") and k != "quantization_config"}
    return DeepseekV4Config(**raw)


def load_main_model(checkpoint: Checkpoint):
    """The official DeepseekV4Model over the checkpoint's main layers (float32), for --main-model."""
    return load_main(checkpoint, DeepseekV4Model, main_text_config(checkpoint), main_layout(),
                     DeepseekV4RotaryEmbedding)


def main_model_hidden(model, sequence: np.ndarray) -> np.ndarray:
    """H [T, hc·D]: the main model's LAST BLOCK OUTPUT STREAMS, taken by a forward hook on its last decoder layer,
    before DeepseekV4Model's hc_head and final norm. Neither what the model returns (collapsed and normed) nor the
    last `output_hidden_states` entry (transformers ties it to that) is what the MTP reads."""
    _, streams = run_main_model(model, sequence, capture=model.layers[-1])  # (T, hc, D)
    return streams.flatten(1).float().numpy()


@torch.inference_mode()
def main_lm_head_input(checkpoint: Checkpoint, hidden: np.ndarray) -> np.ndarray:
    """The main model's lm_head input [N, D] for stream rows H [N, hc·D]: its own hc_head collapse, then its final
    norm (DeepseekV4Model's last line), from the checkpoint's main `hc_head_*` and `norm.weight` (accept's greedy
    targets)."""
    cfg, text = checkpoint.config, head_text_config(checkpoint.config)
    names = {"hc_fn": "hc_head_fn", "hc_base": "hc_head_base", "hc_scale": "hc_head_scale", "norm": "norm.weight"}
    missing = [n for n in names.values() if n not in checkpoint.names()]
    if missing:
        raise CheckpointError(f"{checkpoint.path} has no {', '.join(missing)}: the greedy target is the main model's "
                              f"argmax, lm_head(norm(hc_head(H))), and H here is the main model's streams, so "
                              f"accept needs the main model's hc_head and final norm. Use --target text, or copy "
                              f"the complete checkpoint.")
    value = {key: torch.from_numpy(checkpoint.read(name)) for key, name in names.items()}
    hc_head, norm = DeepseekV4HyperHead(text), DeepseekV4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    hc_head.load_state_dict({k: value[k] for k in ("hc_fn", "hc_base", "hc_scale")})
    norm.load_state_dict({"weight": value["norm"]})
    streams = torch.from_numpy(np.ascontiguousarray(hidden)).view(len(hidden), cfg.hc_mult, cfg.hidden_size)
    return norm(hc_head(streams[None]))[0].numpy()  # (1, N, hc, D) -> (N, D)


__all__ = ["V4MtpHead", "attention_with_uniform_weights", "build_head", "embedding_rows", "head_text_config",
           "load_main_model", "main_lm_head_input", "main_model_hidden", "main_text_config",
           "official_layer_stepwise", "qk_output_projection", "qk_part_variants", "run_batched", "run_stepwise",
           "sliding_mask", "torch_weights"]
