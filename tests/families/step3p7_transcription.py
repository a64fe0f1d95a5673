"""An independent float64 transcription of the Step-3.5/3.7-Flash (`step3p7`) MTP head's draft loop at every depth
(issue 25's "independent transcriptions at every depth"), written from transformers 5.24's modeling_step3p7.py /
modular_step3p7.py and configuration_step3p7.py read as text, `transformers.modeling_layers.MtpLayer`/`MtpModel`
and shared/reference/mtp_wiring.md §11. It imports neither transformers nor the oracle: every tensor is read from
the checkpoint's safetensors by its release name (model.layers.{num_hidden_layers + i}.*), every operator is a
few lines of torch on float64.

What it transcribes, per MTP layer i (depth i + 1):
- Step3p7RMSNorm: Gemma-style, x / rms(x) * (1 + w), for every norm (enorm, hnorm, input/post-attention, q/k norm,
  shared_head.norm; MtpModel builds its norms with the main model's norm class);
- MtpLayer: fc_in = [enorm(e), hnorm(h)] (`mtp_hidden_states_first` unset), fc = eh_proj(fc_in);
- Step3p7DecoderLayer: res1 = fc + attn(input_layernorm(fc)), res2 = res1 + mlp(post_attention_layernorm(res1));
- Step3p7Attention: q_norm/k_norm per head over head_dim before rope; rope on the first int(head_dim x
  partial_rotary_factor) dims, rotate-half (NeoX) pairs, theta and factor of the layer's type (layer_types[N + i]),
  each type's values read from the first *main* layer of that type (Step3p7TextConfig trims the per-layer lists
  to the main layers and builds rope_parameters per type from them); GQA (query head h reads KV head h // g)
  over the heads the layer's q_proj stores (a release's sliding layers: attention_other_setting's count);
  scores scaled by query_pre_attn_scalar ** -0.5 (default head_dim); a sliding_attention layer sees the keys
  q - k < sliding_window (itself included); the output of each head times sigmoid(g_proj(x)) of that head
  (`gating` true: one gate per head), then o_proj;
- the MLP of the layer's type (moe_layers_enum over the padded range): sparse = sigmoid router, top-k chosen on
  sigmoid + router_bias, weights the chosen sigmoids normalised, experts silu(gate) * up -> down, the sum times
  moe_router_scaling_factor plus the shared expert; dense = silu(gate) * up -> down;
- out = the layer's own shared_head.norm(res2); the draft = argmax(out . lm_head) (MtpModel drafts through the
  main lm_head; the per-layer shared_head.head copies are not read by it).

The loop (teacher-forced, as `mtp-oracle export --chain K` records it): depth j, row s (bridge s) feeds token
token_ids[s + j - 1] at position positions[s] + j - 1, recycles depth j-1's `out` of row s (H for j = 1) and runs
layer j - 1, one causal pass over the depth's rows (each layer keeps its own cache of the teacher-forced rows).

`Wiring` makes one change at a time, so the tests can show the comparison fails where it must (twins).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

Stages = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Wiring:
    """The head's wiring; each field's non-default value is one known engine mistake."""

    hidden_first: bool = False  # concat [hnorm(h), enorm(e)] instead of [enorm(e), hnorm(h)]
    layer_of: Callable[[int], int] = field(default=lambda depth: depth - 1)  # the MTP layer depth j runs
    post_norm_of: Callable[[int], int] = field(default=lambda layer: layer)  # whose shared_head.norm ends a layer
    # the positions of depth j's rows from the bridges' positions (p + j - 1; a frozen chain position: p)
    position_of: Callable[[int, np.ndarray], np.ndarray] = field(default=lambda depth, p: p + depth - 1)
    recycle: str = "out"  # the stage fed to the next depth ("res2": the pre-norm residual)
    draft_table: str = "lm_head.weight"  # what the draft is taken through ("model.embed_tokens.weight": a bug)


@dataclass(frozen=True)
class Head:
    cfg: dict  # text_config as released
    t: dict[str, torch.Tensor]  # float64, by release name

    @property
    def main_layers(self) -> int:
        return self.cfg["num_hidden_layers"]

    @property
    def num_mtp_layers(self) -> int:
        return self.cfg["num_nextn_predict_layers"]

    def prefix(self, layer: int) -> str:
        return f"model.layers.{self.main_layers + layer}."


def load(ckpt: Path) -> Head:
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    tensors = load_file(Path(ckpt) / "model.safetensors")
    return Head(raw.get("text_config", raw), {k: v.double() for k, v in tensors.items()})


# --- the operators -----------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Step3p7RMSNorm: scales by 1 + w (its weight starts at 0)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w)


def layer_type(head: Head, layer: int) -> str:
    types = head.cfg.get("layer_types") or ["full_attention"] * (head.main_layers + head.num_mtp_layers)
    return types[head.main_layers + layer]


def rope_of(head: Head, kind: str) -> tuple[float, float]:
    """(theta, partial factor) of a layer type as Step3p7TextConfig reads them: per-layer lists trimmed to the main
    layers, each type's values taken from its first main layer; a scalar theta shared by all."""
    types = (head.cfg.get("layer_types") or ["full_attention"] * head.main_layers)[: head.main_layers]
    i = types.index(kind)
    theta = head.cfg.get("rope_theta", 10000.0)
    theta = theta[i] if isinstance(theta, list) else theta
    factors = head.cfg.get("partial_rotary_factors")
    return float(theta), float(factors[i]) if factors else 1.0


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, factor: float) -> torch.Tensor:
    """x (n, heads, d): rotate-half rope, frequencies theta ** (-2i / r) for 2i < r = int(d x factor), applied to
    the first 2 x (their count) dims, the rest passed through (an odd r rotates r + 1 dims: the cos/sin width
    apply_rotary_pos_emb slices by is the frequencies doubled)."""
    d = x.shape[-1]
    r = int(d * factor)
    inv = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    half = len(inv)
    angles = positions.double()[:, None] * inv  # (n, half)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def attention(head: Head, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cfg, p, eps = head.cfg, head.prefix(layer) + "self_attn.", head.cfg["rms_norm_eps"]
    t = head.t
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # the heads the stored q_proj holds: a release's sliding layers have their own count (attention_other_setting)
    heads, kv_heads = t[p + "q_proj.weight"].shape[0] // d, cfg["num_key_value_heads"]
    n = len(x)
    kind = layer_type(head, layer)
    theta, factor = rope_of(head, kind)
    q = rms_norm((x @ t[p + "q_proj.weight"].T).view(n, heads, d), t[p + "q_norm.weight"], eps)
    k = rms_norm((x @ t[p + "k_proj.weight"].T).view(n, kv_heads, d), t[p + "k_norm.weight"], eps)
    v = (x @ t[p + "v_proj.weight"].T).view(n, kv_heads, d)
    q, k = rope(q, positions, theta, factor), rope(k, positions, theta, factor)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = (cfg.get("query_pre_attn_scalar") or d) ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = positions[None, :] <= positions[:, None]
    if kind == "sliding_attention":
        visible &= positions[:, None] - positions[None, :] < cfg["sliding_window"]
    weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", weights, v)  # (n, heads, d)
    gate = torch.sigmoid(x @ t[p + "g_proj.weight"].T)  # (n, heads): one gate per head
    return (out * gate[..., None]).reshape(n, heads * d) @ t[p + "o_proj.weight"].T


def _swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def sparse_layer(head: Head, layer: int) -> bool:
    """moe_layers_enum over the padded (main + MTP) range; absent: layers 3.. are sparse (the config's default)."""
    enum = head.cfg.get("moe_layers_enum")
    index = head.main_layers + layer
    if enum is None:
        return index >= 3
    items = enum.split(",") if isinstance(enum, str) else enum
    return index in {int(i) for i in items if str(i).strip()}


def mlp(head: Head, layer: int, x: torch.Tensor) -> Stages:
    p, t = head.prefix(layer), head.t
    if not sparse_layer(head, layer):
        return {"mlp": _swiglu(x, *(t[p + f"mlp.{w}_proj.weight"] for w in ("gate", "up", "down")))}
    logits = x @ t[p + "moe.gate.weight"].T  # (n, E)
    scores = torch.sigmoid(logits)
    k = head.cfg["num_experts_per_tok"]
    ids = torch.topk(scores + t[p + "moe.router_bias"], k, dim=-1).indices  # chosen on the biased scores
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True)  # the unbiased sigmoids, normalised
    routed = torch.zeros_like(x)
    for row in range(len(x)):
        for slot in range(k):
            e = int(ids[row, slot])
            routed[row] += weights[row, slot] * _swiglu(x[row], t[p + "moe.gate_proj.weight"][e],
                                                        t[p + "moe.up_proj.weight"][e], t[p + "moe.down_proj.weight"][e])
    shared = _swiglu(x, *(t[p + f"share_expert.{w}_proj.weight"] for w in ("gate", "up", "down")))
    scaled = routed * head.cfg.get("moe_router_scaling_factor", 1.0)
    return {"router_logits": logits, "topk_ids": ids, "topk_weights": weights, "routed": routed, "shared": shared,
            "mlp": scaled + shared}


def layer_stages(head: Head, layer: int, embed: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 wiring: Wiring = Wiring()) -> Stages:
    """Every stage of MTP layer `layer` over n rows (one causal pass), by the trace's stage names."""
    p, t, eps = head.prefix(layer), head.t, head.cfg["rms_norm_eps"]
    s: Stages = {"e": rms_norm(embed, t[p + "enorm.weight"], eps), "h": rms_norm(hidden, t[p + "hnorm.weight"], eps)}
    s["fc_in"] = torch.cat([s["h"], s["e"]] if wiring.hidden_first else [s["e"], s["h"]], dim=-1)
    s["fc"] = s["fc_in"] @ t[p + "eh_proj.weight"].T
    s["ah"] = rms_norm(s["fc"], t[p + "input_layernorm.weight"], eps)
    s["attn"] = attention(head, layer, s["ah"], positions)
    s["res1"] = s["fc"] + s["attn"]
    s["mh"] = rms_norm(s["res1"], t[p + "post_attention_layernorm.weight"], eps)
    s |= mlp(head, layer, s["mh"])
    s["res2"] = s["res1"] + s["mlp"]
    norm = head.prefix(wiring.post_norm_of(layer)) + "shared_head.norm.weight"
    s["out"] = rms_norm(s["res2"], t[norm], eps)
    s["draft"] = (s["out"] @ t[wiring.draft_table].T).argmax(-1, keepdim=True)
    return s


@dataclass
class Depth:
    depth: int
    layer: int
    bridge: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    stages: dict[str, np.ndarray]


def draft_loop(head: Head, token_ids: np.ndarray, hidden: np.ndarray, positions: np.ndarray, depths: int,
               wiring: Wiring = Wiring()) -> dict[int, Depth]:
    """Teacher-forced depths 1..`depths`: depth j over the bridges s = 0..T-j (see the module docstring)."""
    recycled = torch.from_numpy(np.asarray(hidden)).double()
    out: dict[int, Depth] = {}
    for depth in range(1, depths + 1):
        n = len(token_ids) - depth + 1
        tokens = np.asarray(token_ids[depth - 1: depth - 1 + n], dtype=np.int64)
        at = wiring.position_of(depth, np.asarray(positions[:n], dtype=np.int64))
        layer = wiring.layer_of(depth)
        embed = head.t["model.embed_tokens.weight"][torch.from_numpy(tokens)]
        stages = layer_stages(head, layer, embed, recycled[:n], torch.from_numpy(at), wiring)
        out[depth] = Depth(depth, layer, np.arange(n), tokens, at, {k: v.numpy() for k, v in stages.items()})
        recycled = stages[wiring.recycle]
    return out
