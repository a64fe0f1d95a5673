"""`--explain` for the Qwen-stem families (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next): the head's stages as operators
and its known wiring variants as patches (the interface of oracle/variants.py: `explain_ops`, `EXPLAIN_VARIANTS`,
which the three head modules import, as deepseek_v3.py and glm4_moe.py import oracle/families/mtp_layer_explain.py).

What it is: `StageOps.compute(name, s)` is stage `name` from the named stages in `s`, with the official modules the
head `build_head` loaded (the same calls, one per stage, as `MtpHead.stem`/`tail`; the MoE stages through the official
router, experts and shared expert). Fed the oracle's own stages it reproduces the trace (tests/probe/test_explain.py).
A variant is the same head with ONE wiring change made by patching a copy of a module or of a weight (never
transformers' code): e.g. `qgate_halves` permutes q_proj's rows, `no_gate` zeroes the gate rows and doubles
o_proj (sigmoid(0) = 1/2, exact), `rope_interleaved` permutes the rotary dims of q, k and their norms so NeoX
halves act as GPT-J pairs.
What it is not: a transcription, or imported on any path but --explain (the head modules import it, but it loads
nothing beyond the head's own transformers classes; `topk_not_renormalised` imports Qwen3-Next's router when run).
"""

import copy
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from oracle.families.torch_parts import causal_mask
from oracle.trace import TraceInputs
from oracle.variants import _identity_router, _linear, _module_copy, _weight

Tensor = torch.Tensor


# Coverage: which attribute of StageOps holds the module that owns a checkpoint tensor (path to the owner, leaf).
OWNERS = {
    "mtp.pre_fc_norm_embedding.weight": ((), "pre_e"), "mtp.pre_fc_norm_hidden.weight": ((), "pre_h"),
    "mtp.fc.weight": ((), "fc"), "mtp.layers.0.input_layernorm.weight": ((), "in_norm"),
    "mtp.layers.0.post_attention_layernorm.weight": ((), "post_norm"), "mtp.norm.weight": ((), "final_norm"),
    **{f"mtp.layers.0.self_attn.{p}.weight": (("attn",), p) for p in ("q_proj", "k_proj", "v_proj", "q_norm",
                                                                      "k_norm", "o_proj")},
    **{f"mtp.layers.0.mlp.{p}_proj.weight": (("mlp",), f"{p}_proj") for p in ("gate", "up", "down")},
    "mtp.layers.0.mlp.gate.weight": (("mlp",), "gate"),
    **{f"mtp.layers.0.mlp.shared_expert.{p}_proj.weight": (("mlp", "shared_expert"), f"{p}_proj")
       for p in ("gate", "up", "down")},
    "mtp.layers.0.mlp.shared_expert_gate.weight": (("mlp",), "shared_expert_gate"),
}


class StageOps:
    """The Qwen head's stages as operators: `compute(name, s)` is stage `name` from the stages in `s` (each a
    [T, width] tensor), with the head's official modules. Attributes are the modules and the rope/mask a
    variant may replace (on a shallow copy of this object)."""

    owners = OWNERS

    def __init__(self, head, rotary, inputs: TraceInputs):
        layer = head.layers[0]
        self.head, self.rotary, self.text_config = head, rotary, head.text_config
        self.embed = torch.from_numpy(np.ascontiguousarray(inputs.embed))
        self.hidden = torch.from_numpy(np.ascontiguousarray(inputs.hidden))
        self.positions = torch.from_numpy(np.asarray(inputs.positions, dtype=np.int64))[None]
        self.num_tokens = inputs.num_tokens
        self.rope = rotary(self.embed[None], self.positions)
        self.mask = causal_mask(self.num_tokens)
        self.pre_e, self.pre_h, self.fc = head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.fc
        self.in_norm, self.attn, self.post_norm = layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm
        self.mlp, self.final_norm = layer.mlp, head.norm
        self.moe = hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
        self.concat_order = ("e", "h")
        self.shared_gated = True
        self.order = (("e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh")
                      + (("router_logits", "topk_ids", "topk_weights", "shared", "routed") if self.moe else ())
                      + ("mlp", "res2", "out"))
        self.uses = self._uses()

    def _uses(self) -> dict[str, str]:
        """Checkpoint tensor -> the first stage that reads it (routed experts are measured separately)."""
        uses = {"mtp.pre_fc_norm_embedding.weight": "e", "mtp.pre_fc_norm_hidden.weight": "h",
                "mtp.fc.weight": "fc", "mtp.layers.0.input_layernorm.weight": "ah",
                "mtp.layers.0.post_attention_layernorm.weight": "mh", "mtp.norm.weight": "out"}
        uses |= {f"mtp.layers.0.self_attn.{p}.weight": "attn" for p in ("q_proj", "k_proj", "v_proj", "q_norm",
                                                                         "k_norm", "o_proj")}
        prefix = "mtp.layers.0.mlp."
        if self.moe:
            uses[prefix + "gate.weight"] = "router_logits"
            uses |= {f"{prefix}shared_expert.{p}_proj.weight": "shared" for p in ("gate", "up", "down")}
            uses[prefix + "shared_expert_gate.weight"] = "shared"
        else:
            uses |= {f"{prefix}{p}_proj.weight": "mlp" for p in ("gate", "up", "down")}
        return uses

    def copy(self) -> "StageOps":
        return copy.copy(self)

    def prefix(self, n: int) -> "StageOps":
        """These operators over the first n tokens only (exact for them: step t depends on tokens <= t)."""
        if n >= self.num_tokens:
            return self
        ops = self.copy()
        ops.embed, ops.hidden, ops.positions = self.embed[:n], self.hidden[:n], self.positions[:, :n]
        ops.rope = tuple(r[:, :n] for r in self.rope)
        ops.mask, ops.num_tokens = self.mask[:, :, :n, :n], n
        return ops

    @torch.inference_mode()
    def compute(self, name: str, s: dict[str, Tensor]) -> Tensor:
        if name == "e":
            return self.pre_e(self.embed)
        if name == "h":
            return self.pre_h(self.hidden)
        if name == "fc_in":
            return torch.cat([s[self.concat_order[0]], s[self.concat_order[1]]], dim=-1)
        if name == "fc":
            return self.fc(s["fc_in"])
        if name == "ah":
            return self.in_norm(s["fc"])
        if name == "attn":  # from the given ah rows of every token: step t attends to rows 0..t (self.mask)
            return self.attn(s["ah"][None], position_embeddings=self.rope, attention_mask=self.mask)[0][0]
        if name == "res1":
            return s["fc"] + s["attn"]
        if name == "mh":
            return self.post_norm(s["res1"])
        if name == "router_logits":
            return self.mlp.gate(s["mh"])[0]
        if name in ("topk_ids", "topk_weights"):  # the official router's selection from the given logits
            _, weights, ids = _identity_router(self.mlp.gate)(s["router_logits"])
            return ids if name == "topk_ids" else weights
        if name == "shared":
            out = self.mlp.shared_expert(s["mh"])
            return torch.sigmoid(self.mlp.shared_expert_gate(s["mh"])) * out if self.shared_gated else out
        if name == "routed":
            return self.mlp.experts(s["mh"], s["topk_ids"].long(), s["topk_weights"])
        if name == "mlp":
            return s["routed"] + s["shared"] if self.moe else self.mlp(s["mh"][None])[0]
        if name == "res2":
            return s["res1"] + s["mlp"]
        if name == "out":
            return self.final_norm(s["res2"])
        raise KeyError(f"no operator for stage {name!r}")


def explain_ops(head, rotary, inputs: TraceInputs, cfg) -> StageOps:
    """The operators oracle/variants.py's Explainer runs for any Qwen-stem head (`cfg` is not needed: the head's
    text config carries everything the operators read)."""
    return StageOps(head, rotary, inputs)


# ---- variants: one wiring change each ------------------------------------------------------------------------

def _minus_one(norm: nn.Module) -> nn.Module:
    """(1 + (w - 1)) x̂ = w x̂: the plain-norm flavour through the official (1+w) module."""
    return _module_copy(norm, weight=nn.Parameter(norm.weight.detach() - 1.0, requires_grad=False))


def _attn_shape(ops: StageOps) -> tuple[int, int, int]:
    cfg = ops.text_config
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def concat_swap(ops: StageOps) -> StageOps:
    ops = ops.copy()
    ops.concat_order = ("h", "e")
    return ops


def plain_norm(ops: StageOps) -> StageOps:
    ops = ops.copy()
    for name in ("pre_e", "pre_h", "in_norm", "post_norm", "final_norm"):
        setattr(ops, name, _minus_one(getattr(ops, name)))
    ops.attn = _module_copy(ops.attn, q_norm=_minus_one(ops.attn.q_norm), k_norm=_minus_one(ops.attn.k_norm))
    return ops


def qgate_halves(ops: StageOps) -> StageOps:
    """Candidate reads q_h from rows [h·hd, (h+1)·hd) and gate_h from rows [(H+h)·hd, …); the official module
    reads them per head from [2h·hd, …) and [(2h+1)·hd, …): hand it the rows the candidate reads, in its layout."""
    heads, _, hd = _attn_shape(ops)
    w = _weight(ops.attn.q_proj)
    rows = torch.cat([torch.cat([torch.arange(h * hd, (h + 1) * hd), torch.arange((heads + h) * hd, (heads + h + 1) * hd)])
                      for h in range(heads)])
    ops = ops.copy()
    ops.attn = _module_copy(ops.attn, q_proj=_linear(w[rows]))
    return ops


def no_gate(ops: StageOps) -> StageOps:
    """Gate rows zeroed (sigmoid(0) = 1/2) and o_proj doubled: exactly the ungated output."""
    heads, _, hd = _attn_shape(ops)
    w = _weight(ops.attn.q_proj).clone().view(heads, 2 * hd, -1)
    w[:, hd:] = 0
    o = _weight(ops.attn.o_proj) * 2
    ops = ops.copy()
    ops.attn = _module_copy(ops.attn, q_proj=_linear(w.view(2 * heads * hd, -1)), o_proj=_linear(o))
    return ops


def no_qk_norm(ops: StageOps) -> StageOps:
    ops = ops.copy()
    ops.attn = _module_copy(ops.attn, q_norm=nn.Identity(), k_norm=nn.Identity())
    return ops


def rope_all_dims(ops: StageOps) -> StageOps:
    text = copy.copy(ops.text_config)
    text.rope_parameters = dict(text.rope_parameters) | {"partial_rotary_factor": 1.0}
    if hasattr(text, "partial_rotary_factor"):
        text.partial_rotary_factor = 1.0
    ops = ops.copy()
    ops.rope = type(ops.rotary)(text)(ops.embed[None], ops.positions)
    return ops


def rope_interleaved(ops: StageOps) -> StageOps:
    """GPT-J pairs (2i, 2i+1) are NeoX halves (i, i + rot/2) after permuting each head's rotary dims by
    [0, 2, 4, …, 1, 3, 5, …]; q·k is unchanged by permuting q and k alike, and q_norm/k_norm are per element."""
    heads, kv_heads, hd = _attn_shape(ops)
    rot = ops.rope[0].shape[-1]
    perm = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, hd)])
    q_rows = torch.cat([torch.cat([2 * h * hd + perm, torch.arange((2 * h + 1) * hd, (2 * h + 2) * hd)])
                        for h in range(heads)])
    k_rows = torch.cat([h * hd + perm for h in range(kv_heads)])
    attn = ops.attn
    ops = ops.copy()
    ops.attn = _module_copy(
        attn, q_proj=_linear(_weight(attn.q_proj)[q_rows]), k_proj=_linear(_weight(attn.k_proj)[k_rows]),
        q_norm=_module_copy(attn.q_norm, weight=nn.Parameter(attn.q_norm.weight.detach()[perm], requires_grad=False)),
        k_norm=_module_copy(attn.k_norm, weight=nn.Parameter(attn.k_norm.weight.detach()[perm], requires_grad=False)))
    return ops


def no_rope(ops: StageOps) -> StageOps:
    ops = ops.copy()
    cos, sin = ops.rope
    ops.rope = (torch.ones_like(cos), torch.zeros_like(sin))
    return ops


def pos_frozen(ops: StageOps) -> StageOps:
    ops = ops.copy()
    ops.rope = ops.rotary(ops.embed[None], ops.positions[:, :1].expand_as(ops.positions))
    return ops


def no_kv_append(ops: StageOps) -> StageOps:
    ops = ops.copy()
    t = ops.num_tokens
    ops.mask = torch.full((t, t), torch.finfo(torch.float32).min).fill_diagonal_(0)[None, None]
    return ops


def pre_norm_hidden(ops: StageOps) -> str:
    return ("needs the main model's pre-final-norm hidden, which a trace does not hold (it records the "
            "post-norm H the head consumes)")


def topk_not_renormalised(ops: StageOps) -> "StageOps | str":
    if not getattr(ops.text_config, "norm_topk_prob", True):
        return "the reference itself does not renormalise (norm_topk_prob false)"
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    text = copy.copy(ops.text_config)
    text.norm_topk_prob = False
    router = Qwen3NextTopKRouter(text)
    router.weight = nn.Parameter(ops.mlp.gate.weight.detach(), requires_grad=False)
    ops = ops.copy()
    ops.mlp = _module_copy(ops.mlp, gate=router)
    return ops


def shared_ungated(ops: StageOps) -> StageOps:
    ops = ops.copy()
    ops.shared_gated = False
    return ops


# name -> (the first stage it changes, patch). Descriptions live in the family's Variant catalogue.
EXPLAIN_VARIANTS: dict[str, tuple[str, Callable]] = {
    "concat_swap": ("fc_in", concat_swap), "plain_norm": ("e", plain_norm), "qgate_halves": ("attn", qgate_halves),
    "no_gate": ("attn", no_gate), "no_qk_norm": ("attn", no_qk_norm), "rope_all_dims": ("attn", rope_all_dims),
    "rope_interleaved": ("attn", rope_interleaved), "no_rope": ("attn", no_rope), "pos_frozen": ("attn", pos_frozen),
    "no_kv_append": ("attn", no_kv_append), "pre_norm_hidden": ("h", pre_norm_hidden),
    "topk_not_renormalised": ("topk_ids", topk_not_renormalised), "shared_ungated": ("shared", shared_ungated),
}
