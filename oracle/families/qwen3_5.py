"""The Qwen3.5 (dense) MTP head, rebuilt from the official transformers operator classes.

What it is: `Qwen3_5RMSNorm`, `Qwen3_5Attention`, `Qwen3_5MLP` and `Qwen3_5TextRotaryEmbedding` instances (the
attention, MLP and two layer norms held in an official `Qwen3_5DecoderLayer`), loaded strictly with the
checkpoint's 15 `mtp.*` tensors. Only the wiring is transcribed, one line per stage: the stem (two norms, concat,
fc), the residual adds and the final norm, in `MtpHead.stem` and `MtpHead.tail`.
What it is not: a reimplementation of any operator, or an MTP module shipped by transformers (there is none:
transformers drops `mtp.*` on load). The head has its own one-layer KV cache, never a main model's.

Step i consumes (token t_{i+1}, main-model hidden H_i, position p_i). Teacher-forced inputs are known up front,
so `run_batched` runs all T steps as one causal pass; `run_stepwise` feeds one step at a time through the cache.
"""

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                          Qwen3_5TextModel, Qwen3_5TextRotaryEmbedding)

from oracle.attention_evidence import uniform_weights
from oracle.checkpoint import Checkpoint, HeadWeights
from oracle.errors import CheckpointError
from oracle.families.qwen3_5_layout import HeadConfig
from oracle.stages import STAGE_NAMES
from oracle.trace import TraceInputs

Stages = dict[str, torch.Tensor]


def head_text_config(cfg: HeadConfig) -> Qwen3_5TextConfig:
    """A one-layer Qwen3_5TextConfig for the head: layer 0 is full attention, attention is eager with our mask."""
    text = Qwen3_5TextConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu", attention_bias=False,
        num_hidden_layers=1, layer_types=["full_attention"],  # the MTP layer is always full attention
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,  # never the 1e4 default
                         "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section), "mrope_interleaved": cfg.mrope_interleaved},
    )
    # Eager is not causal without a mask, so the batched pass passes an explicit one (causal_mask).
    text._attn_implementation = "eager"
    return text


class MtpHead(nn.Module):
    """Module names mirror the checkpoint (`mtp.` stripped), so the state dict loads strictly by name."""

    def __init__(self, text: Qwen3_5TextConfig):
        super().__init__()
        d, eps = text.hidden_size, text.rms_norm_eps
        self.text_config = text
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(text, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(d, eps=eps)

    def stem(self, embed: torch.Tensor, hidden: torch.Tensor) -> Stages:
        s = {}
        # Qwen3_5RMSNorm scales by (1 + w) (zero-centred weights); a plain `w` norm runs and is wrong.
        s["e"] = self.pre_fc_norm_embedding(embed)
        # `hidden` is the main model's POST-final-norm H (the lm_head input), normed again by the head's own norm.
        s["h"] = self.pre_fc_norm_hidden(hidden)
        # Embedding FIRST: fc was trained on [e, h]; [h, e] has the same shape and runs.
        s["fc_in"] = torch.cat([s["e"], s["h"]], dim=-1)  # (B, T, D) x 2 -> (B, T, 2D)
        s["fc"] = self.fc(s["fc_in"])  # (B, T, 2D) -> (B, T, D)
        return s

    def tail(self, fc: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
             cache: DynamicCache | None) -> Stages:
        layer, s = self.layers[0], {}
        s["ah"] = layer.input_layernorm(fc)
        # Official Qwen3_5Attention: q_proj rows are per-head [q_h | gate_h] and are split per head inside it,
        # then q_norm/k_norm (1+w), partial NeoX RoPE, GQA, and attn * sigmoid(gate) before o_proj.
        s["attn"] = layer.self_attn(s["ah"], position_embeddings=rope, attention_mask=mask, cache=cache)[0]
        s["res1"] = fc + s["attn"]
        s["mh"] = layer.post_attention_layernorm(s["res1"])
        s["mlp"] = layer.mlp(s["mh"])
        s["res2"] = s["res1"] + s["mlp"]
        s["out"] = self.norm(s["res2"])
        return s

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None = None, cache: DynamicCache | None = None) -> Stages:
        stem = self.stem(embed, hidden)
        return stem | self.tail(stem["fc"], rope, mask, cache)


class UpcastLinear(nn.Module):
    """A bias-free linear whose weight stays in the checkpoint's dtype (bf16: half the memory of float32) and is
    widened to float32 exactly, ROWS output rows at a time into one reused buffer, right before the matmul.

    It computes F.linear(x, weight.float()) without ever holding the float32 weight; the output is bit-identical
    to it (tests/oracle/test_head.py), because each output column reduces over the same K as before.
    """

    ROWS = 256

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        # Allocated once: a fresh buffer per call would pay its page faults on every matmul.
        self.block = torch.empty(min(self.ROWS, weight.shape[0]), weight.shape[1], dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_features = self.weight.shape[0]
        out = x.new_empty(*x.shape[:-1], out_features)
        for start in range(0, out_features, self.ROWS):
            stop = min(start + self.ROWS, out_features)
            rows = self.block[: stop - start]
            rows.copy_(self.weight[start:stop])  # exact widening: bf16 is the top half of a float32
            out[..., start:stop] = F.linear(x, rows)
        return out


def _upcast_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` (official modules included) by an UpcastLinear on its weight."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, UpcastLinear(child.weight.data))
        else:
            _upcast_linears(child)


def torch_weights(weights: HeadWeights) -> dict[str, torch.Tensor]:
    """Stored head tensors as torch tensors, sharing memory: bf16 bit patterns become torch.bfloat16."""
    as_torch = {"F32": lambda a: torch.from_numpy(a), "F16": lambda a: torch.from_numpy(a),
                "BF16": lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)}
    return {name: as_torch[weights.dtypes[name]](arr) for name, arr in weights.tensors.items()}


def build_head(cfg: HeadConfig, weights: dict[str, torch.Tensor]) -> tuple[MtpHead, Qwen3_5TextRotaryEmbedding]:
    """The head with every `mtp.*` tensor loaded (strict: none missing, none unused, none left at init).

    Linear weights keep their dtype (widened block-wise by UpcastLinear); norm weights become float32."""
    text = head_text_config(cfg)
    with torch.device("meta"):  # no default init of full-size modules: every parameter must come from `weights`
        head = MtpHead(text)
    state = {name.removeprefix("mtp."): t if t.dim() == 2 else t.float() for name, t in weights.items()}
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"the head's tensors do not match the Qwen3.5 head modules: {err}") from None
    left_on_meta = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise RuntimeError(f"parameters never loaded: {left_on_meta}")  # a bug: strict loading should prevent it
    _upcast_linears(head)
    rotary = Qwen3_5TextRotaryEmbedding(text)  # built for real: its inv_freq buffer is computed, not loaded
    return head.eval(), rotary


def causal_mask(num_steps: int) -> torch.Tensor:
    """Additive mask (1, 1, T, T): step i attends to steps 0..i of the head's own KV."""
    blocked = torch.triu(torch.ones(num_steps, num_steps, dtype=torch.bool), diagonal=1)
    return torch.zeros(num_steps, num_steps).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


def _step_tensors(inputs: TraceInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embed = torch.from_numpy(inputs.embed)[None]  # (T, D) -> (1, T, D)
    hidden = torch.from_numpy(inputs.hidden)[None]  # (T, D) -> (1, T, D)
    positions = torch.from_numpy(inputs.positions)[None]  # (T,) -> (1, T)
    return embed, hidden, positions


def _to_numpy(stages: Stages) -> dict[str, np.ndarray]:
    return {name: stages[name][0].numpy() for name in STAGE_NAMES}  # (1, T, w) -> (T, w)


@torch.inference_mode()
def run_batched(head: MtpHead, rotary: Qwen3_5TextRotaryEmbedding, inputs: TraceInputs) -> dict[str, np.ndarray]:
    """All T steps as one causal pass (teacher forcing: every step's inputs are known up front)."""
    embed, hidden, positions = _step_tensors(inputs)
    rope = rotary(embed, positions)
    return _to_numpy(head(embed, hidden, rope, causal_mask(inputs.num_tokens)))


@torch.inference_mode()
def attention_with_uniform_weights(head: MtpHead, rotary: Qwen3_5TextRotaryEmbedding, inputs: TraceInputs,
                                   ah: np.ndarray) -> np.ndarray:
    """`attn` [T, D] recomputed from the trace's own `ah` rows with uniform weights over the visible keys (the
    official attention module, only softmax(q·k) replaced: oracle/attention_evidence.py)."""
    embed, _, positions = _step_tensors(inputs)
    rope = rotary(embed, positions)
    with uniform_weights(head.text_config):
        attn = head.layers[0].self_attn(torch.from_numpy(ah)[None], position_embeddings=rope,
                                        attention_mask=causal_mask(inputs.num_tokens))[0]
    return attn[0].numpy()


@torch.inference_mode()
def run_stepwise(head: MtpHead, rotary: Qwen3_5TextRotaryEmbedding, inputs: TraceInputs,
                 on_step: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """One step at a time through the head's own KV cache, as an engine runs it."""
    embed, hidden, positions = _step_tensors(inputs)
    cache = DynamicCache(config=head.text_config)  # the head's own cache, never a main model's
    steps = []
    for t in range(inputs.num_tokens):
        sl = slice(t, t + 1)
        rope = rotary(embed[:, sl], positions[:, sl])
        steps.append(head(embed[:, sl], hidden[:, sl], rope, mask=None, cache=cache))  # one query: sees all keys
        if on_step:
            on_step(t)
    return _to_numpy({name: torch.cat([s[name] for s in steps], dim=1) for name in STAGE_NAMES})


def load_main_model(checkpoint: Checkpoint) -> Qwen3_5TextModel:
    """The checkpoint's main text model (official Qwen3_5TextModel, float32), loaded strictly."""
    raw = checkpoint.raw_config
    text = Qwen3_5TextConfig(**{k: v for k, v in raw.get("text_config", raw).items() if k != "model_type"})
    text._attn_implementation = "sdpa"
    prefix = checkpoint.main_model_prefix()
    names = [n for n in checkpoint.names() if n.startswith(prefix) and not n.startswith("model.visual.")]
    if prefix == "model.":
        names = [n for n in names if not n.startswith("model.language_model.")]
    with torch.device("meta"):
        model = Qwen3_5TextModel(text)
    state = {n.removeprefix(prefix): torch.from_numpy(checkpoint.read(n)) for n in names}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"{checkpoint.path}: the main model's tensors ({prefix}*) do not match "
                              f"Qwen3_5TextModel: {err}") from None
    model.rotary_emb = Qwen3_5TextRotaryEmbedding(text)
    return model.eval()


@torch.inference_mode()
def main_model_hidden(model: Qwen3_5TextModel, sequence: np.ndarray) -> np.ndarray:
    """Post-final-norm hidden [T, D] (the lm_head input) of the main model over `sequence` at positions 0..T-1."""
    ids = torch.from_numpy(np.asarray(sequence, dtype=np.int64))[None]  # (T,) -> (1, T)
    return model(input_ids=ids, use_cache=False).last_hidden_state[0].float().numpy()
