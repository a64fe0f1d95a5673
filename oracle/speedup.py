"""What the head is worth in tokens per second: a small, named cost model of a draft step and a verify step, the
speedup over plain decoding for every k up to the measured depth, and the best k (no torch).

Decode at batch 1 is memory-bound: a step reads every weight it uses once, plus the KV cache at the context
length. So a step's time is its bytes over the memory bandwidth (with a device profile's peak FLOPs as a roofline
floor), and every term is a count of bytes a user can check against the engine's profile:

- draft step (one token through the head): the head layer's stored bytes (norms, fc/eh_proj, attention, dense
  MLP or router + shared experts, and top_k routed experts: at batch 1 a token touches exactly top_k), the
  draft's output projection (the whole V x D lm_head, or the MTP layer's own copy: read once per draft, the term
  that is easy to forget and, at Qwen3.5-27B scale, 3x the layer), one embedding row, and the head's own KV
  cache at the context length.
- verify step of n = k+1 tokens (the main model, from its config): every non-expert weight once, the routed
  experts the n tokens touch (E·(1-(1-top_k/E)^n) distinct experts per MoE layer under independent uniform routing:
  real routing is correlated and touches fewer, so this term is an upper bound), the lm_head, the KV cache of every
  full-attention layer at the context length (MLA: its compressed latent), and the linear-attention layers'
  recurrent state (float32, read and written).
- plain decoding is the verify step of 1 token; a round is one verify of k+1 tokens plus k draft steps, and yields
  E[len](k) = 1 + Σ_{j<=k} Π_{m<=j} α_m tokens (the measured conditional α_j). speedup(k) = E[len](k) · t(plain) /
  (t(verify k+1) + k · t(draft)).

Left out (printed with every table): kernel launch and scheduling overhead (it adds a fixed cost per step, more to
the many small draft steps), tensor/expert parallelism and its communication, batching above 1 (verify then turns
compute-bound), attention FLOPs beyond the roofline, the draft's sampling and the rejection sampler.
"""

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from oracle.accept_conventions import block_bootstrap_sums, block_length, percentile_interval
from oracle.errors import CheckpointError, InputError

# HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s) from the vendors' data sheets (SXM/OAM parts).
DEVICES = {
    "H100": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "B200": (8.0e12, 2250e12),
    "MI300X": (5.3e12, 1307e12),
    "MI325X": (6.0e12, 1307e12),
}
LEFT_OUT = ("left out: kernel launch overhead (and scheduling: a fixed cost per step, more to the many small draft "
            "steps), tensor parallelism (and expert parallelism, their communication), batching above 1 (verify then "
            "turns compute-bound), attention FLOPs beyond the roofline, sampling; routed experts of a verify step "
            "assume independent uniform routing (an upper bound on its reads)")
STATE_BYTES = 4  # linear-attention recurrent state is float32


def parse_bandwidth(text: str) -> float:
    """'4.8TB/s', '3350 GB/s', '900e9' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?:([KMGT])(i?)B/s)?\s*", text or "")
    if m is None:
        raise InputError(f"--bandwidth {text!r}: give bytes per second, e.g. 4.8TB/s, 3350GB/s or 4.8e12.")
    value = float(m[1])
    if m[2]:
        value *= (1024 if m[3] else 1000) ** "KMGT".index(m[2]) * (1024 if m[3] else 1000)
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"--bandwidth {text!r}: must be a positive finite bandwidth.")
    return value


def measured_cpu_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """This machine's read bandwidth, measured on the spot (a sum over a buffer larger than the caches)."""
    import time

    buffer = np.ones(nbytes // 8)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


@dataclass(frozen=True)
class Terms:
    """A step's named byte terms and its FLOPs."""

    bytes: dict[str, float]
    flops: float

    @property
    def total(self) -> float:
        return float(sum(self.bytes.values()))


# ---- the draft step, from the checkpoint's stored tensors ------------------------------------------------------


def draft_terms(head_bytes: dict[str, int], expert_bytes: list[int], top_k: int, lm_head_bytes: int,
                lm_head_params: int, embed_row_bytes: int, head_kv_bytes_per_token: float, context: int,
                head_params: int, expert_params: int, window: int | None = None) -> Terms:
    """A draft step: the head's dense tensors, top_k routed experts (their mean size), the lm_head, one embedding
    row, the head's KV cache at `context` tokens (the last `window` of them for a sliding-window layer)."""
    held = min(context, window) if window else context
    experts = top_k * (sum(expert_bytes) / len(expert_bytes)) if expert_bytes else 0.0
    terms = {"head layer (dense tensors)": float(sum(head_bytes.values())),
             f"head routed experts (top_k={top_k})": experts,
             "draft lm_head (V x D)": float(lm_head_bytes), "embedding row": float(embed_row_bytes),
             f"head KV cache at {context} tokens" + (f" (sliding window: {held})" if held != context else ""):
                 head_kv_bytes_per_token * held}
    flops = 2.0 * (head_params + top_k * expert_params + lm_head_params)
    return Terms({k: v for k, v in terms.items() if v}, flops)


def head_layers(ckpt) -> int:
    """N, the head's MTP layers (transformers' MtpModel heads: depth j runs layer j-1); 1 for one-layer heads."""
    return ckpt.family.layer_count(ckpt.config)


def depth_layer(layers: int, depth: int) -> int:
    """The physical layer depth j runs: j-1 on an N-layer head (MtpModel), 0 on a one-layer head (recycled)."""
    return depth - 1 if layers > 1 else 0


def ggml_bytes(qtype: str, count: int) -> float:
    """Bytes of `count` values stored as a GGUF type: ggml packs them in blocks of `block` values taking `size`
    bytes (gguf.GGML_QUANT_SIZES: F32 (1, 4), BF16 (1, 2), Q8_0 (32, 34), Q4_K (256, 144), ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    except KeyError:
        raise CheckpointError(f"GGUF quant type {qtype!r} is not one the gguf package knows; its stored size is "
                              f"unknown. Pass --main-step-ms and --draft-step-ms measured on the engine.") from None
    return count / block * size


def stored_nbytes(ckpt):
    """name -> the bytes a tensor takes as the release stores it: the safetensors entry's; for a GGUF (whose cache
    holds it dequantized to float32, oracle/gguf_source.py) the quant type the cache record names for it. A fused
    gate_up_proj whose gate and up came in different types (`Q8_0+Q4_K`) is half of each."""
    if ckpt.source.get("format") != "gguf":
        return lambda name: float(ckpt.entry(name).nbytes)
    types = ckpt.source.get("quant_types")
    types = types if isinstance(types, dict) else {}

    def size(name: str) -> float:
        qtype = types.get(name)
        if not isinstance(qtype, str):
            raise CheckpointError(f"the GGUF cache record {ckpt.path}/gguf_source.json names no quant type for "
                                  f"{name}; remove {ckpt.path} and it is rebuilt from the GGUF.")
        parts = qtype.split("+")
        count = math.prod(ckpt.entry(name).shape)
        return sum(ggml_bytes(part, count // len(parts)) for part in parts)

    return size


def head_draft_terms(ckpt, draft_lm_head: str, context: int, kv_bytes: int = 2,
                     stored: dict[str, float] | None = None, layer: int = 0) -> Terms:
    """draft_terms from a checkpoint: MTP layer `layer`'s tensors as stored (Checkpoint.layout; a GGUF's quant
    types), vocabulary tables apart; `stored` overrides some tensors' bytes (a quantized head). Routed experts:
    the layout's, or stacked [E, ...] tensors among the dense ones (MtpModel heads): top_k of E."""
    layout, cfg = ckpt.layout(), ckpt.config
    vocab = cfg.vocab_size
    stored = stored or {}
    nbytes = stored_nbytes(ckpt)
    size = lambda n: stored.get(n, nbytes(n))  # noqa: E731
    one = head_layers(ckpt) == 1  # N-layer heads: layer `layer`'s tensors and any the layers share (Qwen's stem)
    dense = {n: ckpt.entry(n) for n in layout.dense if n in ckpt.names() and (one or cfg.in_layer(n, layer))}
    tables = {n for n, e in dense.items() if len(e.shape) == 2 and e.shape[0] == vocab}  # embedding/head copies
    routed = int(getattr(cfg, "num_experts", 0) or 0)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if routed else 0
    stacks = {n for n, e in dense.items() if routed and len(e.shape) == 3 and e.shape[0] == routed}
    names = (sorted(stacks) if layout.experts is None else
             [n for n in layout.experts.tensor_names() if n in ckpt.names()])
    scales = _scales_of(set(names), dense)  # FP8 experts' block scales (in the dense layout): read with the expert
    head_bytes = {n: size(n) for n in dense if n not in tables | stacks | scales}
    head_params = sum(math.prod(dense[n].shape) for n in head_bytes)
    names = [*names, *sorted(scales)]
    expert_bytes, expert_params = [], 0
    if names:
        count = routed if layout.experts is None else layout.experts.num_experts
        expert_bytes = [sum(size(n) for n in names) / count] * count
        expert_params = sum(math.prod(ckpt.entry(n).shape) for n in names) // count
    lm = ckpt.entry(draft_lm_head)
    lm_bytes = nbytes(draft_lm_head)
    return draft_terms(head_bytes, expert_bytes, top_k, lm_bytes, math.prod(lm.shape), _embedding_row(ckpt, lm_bytes),
                       kv_bytes * head_kv_values_per_token(ckpt), context, head_params, expert_params,
                       head_window(ckpt, layer))


def _scales_of(weights: set[str], dense) -> set[str]:
    """The block scales beside `weights` (`X.weight_scale_inv`, or `X.scale` where a release names them so)."""
    return {n for n in dense if (n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in weights)
            or (n.endswith(".scale") and n.removesuffix("scale") + "weight" in weights)}


def _embedding_row(ckpt, lm_bytes: float) -> float:
    """One row of the main embedding table as stored (the lm_head's row where the checkpoint has no table)."""
    try:
        name = ckpt.main_model_prefix() + "embed_tokens.weight"
    except CheckpointError:
        return lm_bytes / ckpt.config.vocab_size
    return stored_nbytes(ckpt)(name) / ckpt.entry(name).shape[0]


def head_window(ckpt, layer: int) -> int | None:
    """MTP layer `layer`'s sliding window (its own KV cache holds that many tokens), or None: every token. An
    MtpModel head whose config gives every layer one window (MiMo: SWA attention in every MTP layer) has it at
    every layer; Step-3.7's layers are sliding or full per `mtp_layer_types` (the text config's types past the
    main layers)."""
    own = getattr(ckpt.family, "uniform_window", None)  # MtpModelSpec: every layer's one window (MiMo), or None
    if own is not None and own(ckpt.config):
        return int(own(ckpt.config))
    window = ckpt.family.attention_window(ckpt.config)
    if head_layers(ckpt) > 1:
        text = text_config(ckpt.raw_config)
        types = text.get("mtp_layer_types") or (text.get("layer_types") or [])[int(text["num_hidden_layers"]):]
        sliding = layer < len(types) and types[layer] == "sliding_attention"
        window = int(text["sliding_window"]) if sliding and text.get("sliding_window") else None
    return window


def head_kv_values_per_token(ckpt) -> int:
    """Values one MTP layer caches per token: K and V of its own KV heads where the family gives them
    (MtpModelSpec.kv_values_per_token: MiMo's SWA layers' swa_num_key_value_heads x (swa_head_dim +
    swa_v_head_dim), not the main model's full-attention ones), else the main text config's (kv_values_per_token)."""
    own = getattr(ckpt.family, "kv_values_per_token", None)
    return int(own(ckpt.config)) if own is not None else kv_values_per_token(text_config(ckpt.raw_config))


def draft_steps(ckpt, draft_lm_head: str, context: int, depth: int,
                stored: dict[str, float] | None = None) -> tuple[Terms, ...]:
    """The draft step of every depth 1..`depth`: its layer's terms (one-layer heads: the same at every depth)."""
    layers = head_layers(ckpt)
    per_layer = {}
    for j in range(1, depth + 1):
        layer = depth_layer(layers, j)
        if layer not in per_layer:
            per_layer[layer] = head_draft_terms(ckpt, draft_lm_head, context, stored=stored, layer=layer)
    return tuple(per_layer[depth_layer(layers, j)] for j in range(1, depth + 1))


# ---- the verify step, from the main model's config ---------------------------------------------------------------


def text_config(raw: dict) -> dict:
    return raw.get("text_config", raw)


def kv_values_per_token(c: dict) -> int:
    """Values one full-attention layer caches per token: MLA's latent + rope key, or K and V of every KV head."""
    if c.get("kv_lora_rank"):
        return int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 0))
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    return 2 * int(c.get("num_key_value_heads") or heads) * head_dim


def _attention_params(c: dict, sliding: bool = False) -> int:
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3)
        nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kvl, ql = int(c["kv_lora_rank"]), c.get("q_lora_rank")
        q = d * h * (nope + rope) if not ql else d * int(ql) + int(ql) + int(ql) * h * (nope + rope)  # q_a_layernorm
        return q + d * (kvl + rope) + kvl + kvl * h * (nope + v) + h * v * d  # kv_a_layernorm
    hd = int(c.get("head_dim") or d // h)
    kv = int(c.get("num_key_value_heads") or h)
    if _is_step(c):  # Step-3.5/3.7: q/k/v/o, q_norm/k_norm, and a g_proj gate per head (gating true) or value
        if sliding:
            h = int(c.get("num_sliding_attention_heads") or (c.get("attention_other_setting") or {}).get(
                "num_attention_heads") or h)
        gate = h if c.get("gating", True) in (True, "per-head") else h * hd
        return d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd + d * gate
    gate = 2 if _has_output_gate(c) else 1  # Qwen3.5/Qwen3-Next: q_proj emits query and gate
    qk_norm = 2 * hd if gate == 2 or c.get("use_qk_norm") else 0  # q_norm, k_norm
    return d * h * hd * gate + 2 * d * kv * hd + h * hd * d + qk_norm


def _is_step(c: dict) -> bool:
    return str(c.get("model_type", "")).startswith(("step3p5", "step3p7"))


def _moe_layer_flags(c: dict, layers: int, experts: int) -> list[bool]:
    """Which of the main layers 0..layers-1 are MoE: mlp_layer_types ("sparse"), Step's moe_layers_enum, or every
    layer from first_k_dense_replace on (DeepSeek/GLM; Qwen: all)."""
    if not experts:
        return [False] * layers
    if c.get("mlp_layer_types"):
        return [kind == "sparse" for kind in list(c["mlp_layer_types"])[:layers]]
    if c.get("moe_layers_enum") is not None:
        enum = c["moe_layers_enum"]
        chosen = {int(i) for i in (enum.split(",") if isinstance(enum, str) else enum) if str(i).strip()}
        return [i in chosen for i in range(layers)]
    first_dense = int(c.get("first_k_dense_replace") or 0)
    return [i >= first_dense for i in range(layers)]


def _has_output_gate(c: dict) -> bool:
    return bool(c.get("attn_output_gate", str(c.get("model_type", "")).startswith(("qwen3_5", "qwen3_next"))))


def _linear_attention(c: dict) -> tuple[int, int]:
    """(params, recurrent state values) of one Gated DeltaNet layer (Qwen3.5/Qwen3-Next)."""
    d = int(c["hidden_size"])
    nk, dk = int(c["linear_num_key_heads"]), int(c["linear_key_head_dim"])
    nv, dv = int(c["linear_num_value_heads"]), int(c["linear_value_head_dim"])
    conv = (2 * nk * dk + nv * dv) * int(c.get("linear_conv_kernel_dim", 4))
    small = 2 * nv + dv  # A_log, dt_bias, the gated norm
    return d * (2 * nk * dk + 2 * nv * dv) + d * 2 * nv + conv + nv * dv * d + small, nv * dk * dv


@dataclass(frozen=True)
class MainModel:
    """The main model's shapes in parameters: what a verify step reads."""

    dense_params: int  # every weight but the routed experts and the lm_head
    moe_layers: int
    experts: int
    top_k: int
    expert_params: int  # one routed expert
    lm_head_params: int
    full_attention_layers: int
    kv_values_per_token: int
    state_values: int  # linear-attention recurrent state, all layers
    sliding_attention_layers: int = 0  # their KV cache holds the last sliding_window tokens
    sliding_window: int = 0

    def kv_values(self, context: int) -> int:
        """Cached K/V values (or MLA latents) of every attention layer at `context` tokens."""
        windowed = min(context, self.sliding_window) if self.sliding_window else context
        return self.kv_values_per_token * (self.full_attention_layers * context
                                           + self.sliding_attention_layers * windowed)

    def active_params(self, tokens: int) -> float:
        return self.dense_params + self.moe_layers * self.distinct_experts(tokens) * self.expert_params

    def distinct_experts(self, tokens: int) -> float:
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)


def main_model(raw: dict) -> MainModel:
    """Parameter counts from config.json (text_config where nested): dense and MoE MLPs, GQA, MLA and linear
    attention. DeepSeek-V4's hyper-connection streams and compressed attention are not modelled."""
    c = text_config(raw)
    if c.get("hc_mult") or str(c.get("model_type", "")).startswith("deepseek_v4"):
        raise InputError("the speed model does not cover DeepSeek-V4's main model (hyper-connections, compressed "
                         "attention); pass --main-step-ms and --draft-step-ms measured on the engine instead.")
    try:
        d, v, layers = int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
        types = list(c.get("layer_types") or ["full_attention"] * layers)[:layers]  # Step pads it with the MTP layers
        experts = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
        top_k = int(c.get("num_experts_per_tok") or 0)
        moe_i = int(c.get("moe_intermediate_size") or 0)
        shared_i = int(c.get("shared_expert_intermediate_size") or c.get("share_expert_dim")
                       or int(c.get("n_shared_experts") or 0) * moe_i)
        dense_i = int(c.get("intermediate_size") or 0)
        attention, state, full, sliding = 0, 0, 0, 0
        for kind in types:
            if kind == "linear_attention":
                params, values = _linear_attention(c)
                attention, state = attention + params, state + values
            else:
                attention += _attention_params(c, sliding=kind == "sliding_attention")
                full, sliding = (full, sliding + 1) if kind == "sliding_attention" else (full + 1, sliding)
        moe_layers = sum(_moe_layer_flags(c, layers, experts))
        shared_gate = d if c.get("shared_expert_intermediate_size") else 0  # Qwen's sigmoid gate on the shared expert
        router_bias = experts if _is_step(c) or c.get("topk_method") == "noaux_tc" else 0  # e_score_correction
        mlp = ((layers - moe_layers) * 3 * d * dense_i
               + moe_layers * (d * experts + router_bias + 3 * d * shared_i + shared_gate))
        norms = layers * 2 * d + d  # two per layer and the final one (plus one embedding row below)
        window = int(c["sliding_window"]) if sliding else 0
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(f"config.json lacks what the speed model needs ({err}); pass --main-step-ms and "
                         f"--draft-step-ms measured on the engine instead.") from None
    return MainModel(dense_params=attention + mlp + norms + d, moe_layers=moe_layers, experts=experts,
                     top_k=top_k, expert_params=3 * d * moe_i, lm_head_params=v * d, full_attention_layers=full,
                     kv_values_per_token=kv_values_per_token(c), state_values=state,
                     sliding_attention_layers=sliding, sliding_window=window)


def verify_terms(model: MainModel, tokens: int, context: int, weight_bytes: float, lm_head_bytes: float,
                 kv_bytes: int = 2, reuse_experts: bool = False) -> Terms:
    """A verify step of `tokens` tokens at `context` tokens of KV cache. `reuse_experts`: the tokens touch no more
    experts than one token does (the other bound: fully correlated routing, or a batch that reads them anyway)."""
    experts = model.distinct_experts(1 if reuse_experts else tokens)
    terms = {"main weights (dense)": model.dense_params * weight_bytes,
             f"main routed experts ({experts:.1f} distinct per MoE layer)":
                 model.moe_layers * experts * model.expert_params * weight_bytes,
             "main lm_head": model.lm_head_params * lm_head_bytes,
             f"main KV cache at {context} tokens": model.kv_values(context) * kv_bytes,
             "linear-attention state (read + write)": 2 * model.state_values * STATE_BYTES}
    per_token = model.dense_params + model.moe_layers * model.top_k * model.expert_params + model.lm_head_params
    return Terms({k: v for k, v in terms.items() if v}, 2.0 * per_token * tokens)


# ---- time, speedup and the best k --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clock:
    """Bytes to seconds: a bandwidth, optionally a FLOP peak (roofline), or an engine's measured step times."""

    bandwidth: float | None
    peak_flops: float | None = None
    label: str = ""
    main_step_s: float | None = None  # measured: one plain decode step
    draft_step_s: float | None = None  # measured: one draft step

    def time(self, terms: Terms) -> float:
        t = terms.total / self.bandwidth
        return max(t, terms.flops / self.peak_flops) if self.peak_flops else t


def clock_of(bandwidth: str | None, device: str | None, main_step_ms: float | None,
             draft_step_ms: float | None) -> Clock | None:
    """The clock the options ask for; None when none is given (no speed section)."""
    if (main_step_ms is None) != (draft_step_ms is None):
        raise InputError("give both --main-step-ms and --draft-step-ms (the engine's measured plain decode step "
                         "and draft step), or neither.")
    for name, value in (("--main-step-ms", main_step_ms), ("--draft-step-ms", draft_step_ms)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InputError(f"{name} {value}: a positive time in milliseconds.")
    if bandwidth is not None and device is not None:
        raise InputError("give --bandwidth or --device, not both.")
    measured = {} if main_step_ms is None else {"main_step_s": main_step_ms / 1e3, "draft_step_s": draft_step_ms / 1e3}
    if device is not None:
        key = device.upper()
        if key == "CPU":
            bw = measured_cpu_bandwidth()
            return Clock(bw, None, f"{bw / 1e9:.1f} GB/s (this CPU, measured now)", **measured)
        if key not in DEVICES:
            raise InputError(f"--device {device!r}: one of {', '.join(DEVICES)} or cpu (measured on the spot).")
        bw, peak = DEVICES[key]
        return Clock(bw, peak, f"{bw / 1e12:g} TB/s ({key}, {peak / 1e12:g} TFLOP/s bf16 roofline)", **measured)
    if bandwidth is not None:
        bw = parse_bandwidth(bandwidth)
        return Clock(bw, None, f"{bw / 1e12:g} TB/s", **measured)
    if measured:
        return Clock(None, None, "measured step times", **measured)
    return None


@dataclass(frozen=True)
class SpeedRow:
    k: int
    tokens: float  # E[len](k)
    verify_s: float
    draft_s: float  # the draft step at depth k
    drafts_s: float  # the round's k draft steps, depths 1..k (k x draft_s for a one-layer head)
    speedup: float
    interval: tuple[float, float]


@dataclass(frozen=True)
class Speed:
    clock: Clock
    drafts: tuple[Terms, ...]  # the draft step at depths 1..K (an N-layer head: depth j runs layer j-1)
    verify: dict[int, Terms]  # tokens -> terms (1 = plain decoding)
    rows: list[SpeedRow]
    best: SpeedRow
    best_k_range: tuple[int, int]  # the best k's 2.5..97.5 % over the bootstrap resamples
    reuse: "Speed | None" = None  # MoE: the same with the verify's routed experts those of one token
    left_out: str = LEFT_OUT
    notes: list[str] = field(default_factory=list)
    layers: tuple[int, ...] = ()  # the physical MTP layer each depth ran (empty: layer 0 at every depth)

    def layer(self, depth: int) -> int:
        return self.layers[depth - 1] if self.layers else 0

    @property
    def multi_layer(self) -> bool:
        return any(self.layers)


def verify_seconds(clock: Clock, verify: dict[int, Terms], tokens: int) -> float:
    """A verify step of `tokens` tokens: from the model, or the engine's measured plain step scaled by the
    model's byte ratio to a plain step."""
    if clock.main_step_s is not None:
        return clock.main_step_s * verify[tokens].total / verify[1].total
    return clock.time(verify[tokens])


def draft_seconds(clock: Clock, draft: Terms) -> float:
    """One draft step: the engine's measured one where given (the same at every depth), else the model's."""
    return clock.draft_step_s if clock.draft_step_s is not None else clock.time(draft)


def speed_table(runs: np.ndarray, clock: Clock, drafts, verify: dict[int, Terms],
                reuse: dict[int, Terms] | None = None, layers: tuple[int, ...] = ()) -> Speed:
    """Speedup per k from the per-chain accepted runs `runs` [C, K] (column k-1: the drafts accepted of the first
    k, exact 0/1-prefix counts for greedy verification or expected ones for sampled), with a block-bootstrap
    interval over contiguous chains; `drafts` the draft step of depths 1..K (one Terms: the same at every depth),
    `verify` the terms for 1..K+1 tokens, `layers` the MTP layer of each depth (reported)."""
    chains, depth = runs.shape
    drafts = tuple(drafts) if not isinstance(drafts, Terms) else (drafts,) * depth
    if len(drafts) != depth:
        raise ValueError(f"{len(drafts)} draft steps for {depth} depths")  # a caller bug
    plain = verify_seconds(clock, verify, 1)
    draft_s = [draft_seconds(clock, d) for d in drafts]
    sums, rows = block_bootstrap_sums(runs, block_length(chains, depth))
    resampled = 1 + sums / rows  # (B, K): E[len](k) per resample
    table, boot = [], []
    for k in range(1, depth + 1):
        verify_s, drafting = verify_seconds(clock, verify, k + 1), float(sum(draft_s[:k]))
        cost = verify_s + drafting
        tokens = 1 + runs[:, k - 1].mean()
        boot.append(resampled[:, k - 1] * plain / cost)
        table.append(SpeedRow(k, float(tokens), verify_s, draft_s[k - 1], drafting, float(tokens * plain / cost),
                              percentile_interval(boot[-1])))
    best = max(table, key=lambda r: r.speedup)
    winners = np.argmax(np.stack(boot, axis=1), axis=1) + 1
    return Speed(clock, drafts, verify, table, best,
                 (int(np.quantile(winners, 0.025)), int(np.quantile(winners, 0.975))),
                 None if reuse is None else speed_table(runs, clock, drafts, reuse, layers=layers),
                 layers=tuple(layers))


def runs_by_k(right: np.ndarray | None = None, reach: np.ndarray | None = None) -> np.ndarray:
    """[C, K]: per chain, drafts accepted among the first k: min(accepted run, k) for greedy verification (right
    [C, K]), Σ_{j<=k} P(drafts 1..j accepted) for sampled (reach [C, K])."""
    if reach is not None:
        return np.cumsum(reach, axis=1)
    return np.cumsum(np.logical_and.accumulate(right, axis=1), axis=1).astype(float)


def speed_lines(speed: Speed) -> list[str]:
    lines = [f"speed (batch 1, memory-bound decode at {speed.clock.label}):"]
    if speed.clock.main_step_s is not None:
        lines.append(f"  measured: plain step {speed.clock.main_step_s * 1e3:.3f} ms, draft step "
                     f"{speed.clock.draft_step_s * 1e3:.3f} ms (they win over the model; verify of k+1 tokens = "
                     f"the plain step x the model's byte ratio)")
    if speed.multi_layer:
        for depth, terms in enumerate(speed.drafts, start=1):
            lines.append(f"  draft step at depth {depth} (MTP layer {speed.layer(depth)}): {_terms_text(terms)}")
    else:
        lines.append(f"  draft step (every depth, MTP layer 0): {_terms_text(speed.drafts[0])}")
    for tokens in sorted(speed.verify):
        lines.append(f"  verify step of {tokens} token{'s' if tokens > 1 else ''}: {_terms_text(speed.verify[tokens])}")
    lines.append(f"  {'k':>3}  {'E[len](k)':>9}  {'verify ms':>9}  {'k drafts ms':>12}  {'speedup':>8}  95% interval")
    for r in speed.rows:
        lines.append(f"  {r.k:>3}  {r.tokens:>9.3f}  {r.verify_s * 1e3:>9.4g}  {r.drafts_s * 1e3:>12.4g}  "
                     f"{r.speedup:>7.3f}x  ({r.interval[0]:.2f}-{r.interval[1]:.2f})")
    if speed.reuse is not None:
        r = speed.reuse.best
        lines.append(f"  if the k+1 verified tokens touched no more experts than one (correlated routing, or a batch "
                     f"that reads them anyway): best k={r.k}: {r.speedup:.2f}x ({r.interval[0]:.2f}-"
                     f"{r.interval[1]:.2f}); "
                     + ", ".join(f"k={x.k} {x.speedup:.2f}x" for x in speed.reuse.rows))
    lo, hi = speed.best_k_range
    lines.append(f"  best k={speed.best.k}: {speed.best.speedup:.2f}x; the best k over the resamples: "
                 f"{lo}..{hi}" if lo != hi else f"  best k={speed.best.k}: {speed.best.speedup:.2f}x in every resample")
    lines.append(f"  {speed.left_out}")
    return lines + [f"  {n}" for n in speed.notes]


def _terms_text(terms: Terms) -> str:
    parts = ", ".join(f"{name} {value / 1e6:.3f} MB" for name, value in terms.bytes.items())
    return f"{terms.total / 1e6:.3f} MB ({parts}); {terms.flops / 1e9:.3f} GFLOP"


def speed_summary(speed: Speed) -> str:
    r = speed.best
    where = speed.clock.label.split(" (")[0]
    return f"best k={r.k}: {r.speedup:.2f}x ({r.interval[0]:.2f}-{r.interval[1]:.2f}) at {where}"


def _terms_json(terms: Terms) -> dict:
    return {"bytes": terms.bytes, "total_bytes": terms.total, "flops": terms.flops}


def speed_json(speed: Speed) -> dict:
    return {"clock": {"bandwidth_bytes_per_s": speed.clock.bandwidth, "peak_flops": speed.clock.peak_flops,
                      "label": speed.clock.label, "main_step_s": speed.clock.main_step_s,
                      "draft_step_s": speed.clock.draft_step_s},
            "draft_step": _terms_json(speed.drafts[0]),  # depth 1's (every depth's on a one-layer head)
            "draft_steps": [{"depth": j, "layer": speed.layer(j), **_terms_json(t)}
                            for j, t in enumerate(speed.drafts, start=1)],
            "verify_step": {str(n): _terms_json(t) for n, t in speed.verify.items()},
            "rows": [{"k": r.k, "e_len": r.tokens, "verify_s": r.verify_s, "draft_s": r.draft_s,
                      "drafts_s": r.drafts_s, "round_s": r.verify_s + r.drafts_s, "speedup": r.speedup,
                      "interval95": list(r.interval), "layer": speed.layer(r.k)}
                     for r in speed.rows],
            "best": {"k": speed.best.k, "speedup": speed.best.speedup, "interval95": list(speed.best.interval),
                     "k_range95": list(speed.best_k_range)},
            "left_out": speed.left_out, "notes": speed.notes,
            "reusing_experts": None if speed.reuse is None else speed_json(speed.reuse)}


# ---- from a measurement ----------------------------------------------------------------------------------------------


def quantized_bytes(tensors) -> dict[str, float]:
    """Stored bytes of quantized head tensors (oracle/quantize_sim.py): the codes plus a 16-bit scale per row
    (int8) or group (int4/int2), fp8 with a float32 scale per 128x128 block."""
    from oracle.quantize_sim import INT_SCHEMES

    out = {}
    for t in tensors:
        count = math.prod(t.shape)
        if t.spec.scheme in INT_SCHEMES:
            bits, group = INT_SCHEMES[t.spec.scheme]
            out[t.name] = count * (bits + 16 / (group or t.shape[-1])) / 8
        else:  # fp8 e4m3
            out[t.name] = count * (8 + 32 / (128 * 128)) / 8
    return out


def main_weight_bytes(ckpt) -> tuple[float, float, str | None]:
    """(bytes per main-model weight, bytes per lm_head weight, a note on where the first came from): FP8 releases
    store their linears in 1 byte (plus a float32 scale per 128x128 block); a GGUF its main blocks' quant types
    where the file holds them; otherwise the lm_head's own type."""
    from oracle.lm_head import lm_head_of

    try:
        name = lm_head_of(ckpt).name
        lm_bytes = stored_nbytes(ckpt)(name) / math.prod(ckpt.entry(name).shape)
    except CheckpointError:  # a head-only checkpoint without the main lm_head: assume bf16
        lm_bytes = 2.0
    quant = ckpt.raw_config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        return 1 + 4 / (128 * 128), lm_bytes, None
    if ckpt.source.get("format") == "gguf":
        blocks = gguf_main_block_bytes(Path(ckpt.source["file"]), int(text_config(ckpt.raw_config)
                                                                         ["num_hidden_layers"]))
        if blocks is not None:
            return blocks, lm_bytes, (f"main weights at {blocks:.4g} bytes per weight: the GGUF's main blocks' "
                                      f"matrices as stored")
        return lm_bytes, lm_bytes, (f"the GGUF holds no main blocks: main weights taken at its output tensor's "
                                    f"{lm_bytes:.4g} bytes per weight")
    return lm_bytes, lm_bytes, None


def gguf_main_block_bytes(file: Path, layers: int) -> float | None:
    """Bytes per weight of the main blocks' matrices (blk.0..layers-1, 2-D and up) in a GGUF, as stored; None
    when the file holds none (an MTP-only GGUF)."""
    from oracle.gguf_source import _reader

    nbytes, count = 0.0, 0
    for t in _reader(file).tensors:
        parts = t.name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < layers \
                and len(t.shape) >= 2:
            nbytes, count = nbytes + ggml_bytes(t.tensor_type.name, int(t.n_elements)), count + int(t.n_elements)
    return nbytes / count if count else None


def speed_of(result, checkpoint_dir, clock: Clock, context: int | None = None) -> tuple[Speed, Speed | None]:
    """The speed table of an accept result (oracle/accept.py), and with --quantize the unquantized head's too."""
    from oracle.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint_dir)
    depth = result.metrics.k
    context = int(context if context is not None else len(result.sequence))
    weight, lm_bytes, weight_note = main_weight_bytes(ckpt)
    model = main_model(ckpt.raw_config)
    verify = {n: verify_terms(model, n, context, weight, lm_bytes) for n in range(1, depth + 2)}
    reuse = None if not model.experts else {n: verify_terms(model, n, context, weight, lm_bytes, reuse_experts=True)
                                             for n in range(1, depth + 2)}
    sampled = result.stats is not None and result.stats.beta is not None
    runs = (runs_by_k(reach=np.cumprod(result.stats.beta, axis=1)) if sampled
            else runs_by_k(right=result.drafts == result.targets))
    stored = quantized_bytes(result.quantize.head.tensors) if result.quantize is not None else None
    layers = tuple(depth_layer(head_layers(ckpt), j) for j in range(1, depth + 1))
    drafts = draft_steps(ckpt, result.source["lm_head"], context, depth, stored=stored)
    unquantized = None if stored is None else draft_steps(ckpt, result.source["lm_head"], context, depth)
    measured_clock = clock
    if unquantized is not None and clock.draft_step_s is not None:
        # the engine measured its (unquantized) head: the quantized one's step scaled by the bytes it reads
        ratio = drafts[0].total / unquantized[0].total
        measured_clock = replace(clock, draft_step_s=clock.draft_step_s * ratio)
    speed = speed_table(runs, measured_clock, drafts, verify, reuse, layers=layers)
    if measured_clock is not clock:
        speed.notes.append(f"the quantized head's draft step: the measured --draft-step-ms x its byte ratio "
                           f"{ratio:.3f} to the unquantized head (the engine measured the head it ran)")
    speed.notes.append(f"E[len](k) from the measured {'sampled' if sampled else 'greedy'} acceptance; context "
                       f"{context} tokens (--context)")
    if ckpt.source.get("format") == "gguf":
        speed.notes.append(f"bytes of the GGUF's tensors by their quant types ({gguf_types_text(ckpt)}), not the "
                           f"float32 cache the oracle computes with")
    if weight_note:
        speed.notes.append(weight_note)
    if result.quantize is None:
        return speed, None
    if sampled:
        speed.notes.append("the unquantized comparison uses greedy acceptance (its distributions were not formed)")
    base_runs = runs_by_k(right=result.quantize.baseline_drafts == result.targets)
    base = speed_table(base_runs, clock, unquantized, verify, layers=layers)
    return speed, base


def gguf_types_text(ckpt) -> str:
    """`Q8_0 x12, F32 x8`: how many head tensors the GGUF stores in each type."""
    counts: dict[str, int] = {}
    for qtype in (ckpt.source.get("quant_types") or {}).values():
        counts[qtype] = counts.get(qtype, 0) + 1
    return ", ".join(f"{t} x{n}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _round_draft_mb(speed: Speed) -> str:
    """The draft step's size: one figure for a one-layer head, per depth for an N-layer one."""
    if not speed.multi_layer:
        return f"{speed.drafts[0].total / 1e6:.3f} MB"
    return "/".join(f"{t.total / 1e6:.3f}" for t in speed.drafts) + " MB at depths 1.." + str(len(speed.drafts))


def quantized_worth_line(quantized: Speed, base: Speed) -> str:
    q, b = quantized.best, base.best
    better = "worth more" if q.speedup > b.speedup else "worth less" if q.speedup < b.speedup else "worth the same"
    overlap = q.interval[0] <= b.interval[1] and b.interval[0] <= q.interval[1]
    return (f"quantized head: draft step {_round_draft_mb(quantized)} vs {_round_draft_mb(base)} "
            f"unquantized; best k={q.k} {q.speedup:.2f}x ({q.interval[0]:.2f}-{q.interval[1]:.2f}) vs k={b.k} "
            f"{b.speedup:.2f}x ({b.interval[0]:.2f}-{b.interval[1]:.2f}): the quantized head is {better}"
            f"{' (the intervals overlap: not decided)' if overlap and better != 'worth the same' else ''}")
