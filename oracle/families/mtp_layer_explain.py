"""`--explain` for the MtpLayer families (DeepSeek-V3, GLM-4.5): the head's stages as operators and the wiring
variants every such head shares as patches (`COMMON`); each family file adds its attention's own and exports
`explain_ops` and `EXPLAIN_VARIANTS` (the interface of oracle/variants.py).

What it is: `MtpLayerOps.compute(name, s)` is stage `name` from the named stages in `s`, one call per stage with the
official modules the head loaded (MtpLayer's enorm, hnorm, eh_proj and post_norm; the decoder layer's norms, its
attention, MLA or GQA, fed every token's `ah` rows under the causal mask; the noaux_tc router, the eager experts
and the shared experts) -- the same calls whose outputs mtp_layer.MtpLayerHead's hooks record. Fed the trace's own
stages it reproduces them (tests/probe/test_explain_deepseek.py). The top-k selection from given router logits goes
through a copy of the official router whose linear is the identity over E (oracle/variants.py _identity_router).
A variant is one wiring change made on copies of those modules, their weights or attributes (the router's
`num_group`, the attention's `scaling`, a config flag the official forward reads), never on transformers' code;
one that cannot be written that way is a string saying why ("not checkable"), so the report lists it as unchecked
instead of silently missing.
What it is not: a transcription. The routed experts stay lazy (only routed experts are widened, one at a time).
"""

import copy

import numpy as np
import torch
from torch import nn

from oracle.families.moe_experts import _Widened, routed_experts_of
from oracle.families.torch_parts import Fp8Linear, Fp8Weights, RoutedFp8Experts, UpcastLinear, causal_mask, step_tensors
from oracle.trace import TraceInputs
from oracle.variants import _identity_router, _set

Tensor = torch.Tensor
_SCALE = "weight_scale_inv"
MOE_STAGES = ("router_logits", "topk_ids", "topk_weights", "shared", "routed")


def _copy(module: nn.Module, **attrs) -> nn.Module:
    """A shallow copy of `module` with some children, parameters, buffers or plain attributes replaced (the
    original and its dicts untouched)."""
    clone = copy.copy(module)
    clone._modules, clone._parameters, clone._buffers = (dict(module._modules), dict(module._parameters),
                                                         dict(module._buffers))
    for name, value in attrs.items():
        setattr(clone, name, value)
    return clone


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class MtpLayerOps:
    """The MtpLayer head's stages as operators over the reference's inputs. Attributes are the modules, rope,
    mask and position-0 convention a variant may replace (on a shallow copy)."""

    moe = True
    plain_norms = True  # w * x̂ norms: coverage perturbs w by 1% of its own RMS (not of 1 + w)
    checkpoint = None  # the reference's Checkpoint, set by the Explainer (variants that read main-model tensors)

    def __init__(self, head, rotary, inputs: TraceInputs, cfg):
        layer = head.layer
        block = layer.mtp_block
        self.head, self.rotary, self.cfg, self.text_config = head, rotary, cfg, head.text_config
        embed, hidden, positions = step_tensors(inputs)
        self.token_ids = np.asarray(inputs.token_ids)
        self.embed, self.hidden, self.positions = embed[0], hidden[0], positions
        self.num_tokens = inputs.num_tokens
        self.rope = rotary(embed, positions)
        self.mask = causal_mask(self.num_tokens)
        self.mask_pos0 = bool(cfg.mask_pos0_embedding)
        self.enorm, self.hnorm, self.eh_proj = layer.enorm, layer.hnorm, layer.eh_proj
        self.in_norm, self.attn, self.post_norm = block.input_layernorm, block.self_attn, block.post_attention_layernorm
        self.mlp, self.out_norm = block.mlp, layer.post_norm
        self.concat_order = ("e", "h")
        self.order = ("e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh") + MOE_STAGES + ("mlp", "res2", "out")
        self.owners, self.uses = self._owners()
        self.qk_path = tuple(n for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "k_proj", "q_norm",
                                         "k_norm") if getattr(self.attn, n, None) is not None)

    def _owners(self) -> tuple[dict, dict]:
        """Checkpoint tensor -> (path to its owner on these ops, leaf module), and -> the first stage reading it."""
        p = self.cfg.head_prefix
        owners = {p + "enorm.weight": ((), "enorm"), p + "hnorm.weight": ((), "hnorm"),
                  p + "eh_proj.weight": ((), "eh_proj"), p + "input_layernorm.weight": ((), "in_norm"),
                  p + "post_attention_layernorm.weight": ((), "post_norm"),
                  p + "shared_head.norm.weight": ((), "out_norm"), p + "mlp.gate.weight": (("mlp",), "gate")}
        first = {"enorm": "e", "hnorm": "h", "eh_proj": "fc", "in_norm": "ah", "post_norm": "mh", "out_norm": "out",
                 "gate": "router_logits"}
        uses = {name: first[leaf] for name, (_, leaf) in owners.items()}
        for leaf, child in self.attn.named_children():
            if getattr(child, "weight", None) is not None:
                owners[f"{p}self_attn.{leaf}.weight"] = (("attn",), leaf)
                uses[f"{p}self_attn.{leaf}.weight"] = "attn"
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            owners[f"{p}mlp.shared_experts.{leaf}.weight"] = (("mlp", "shared_experts"), leaf)
            uses[f"{p}mlp.shared_experts.{leaf}.weight"] = "shared"
        return owners, uses

    def copy(self) -> "MtpLayerOps":
        return copy.copy(self)

    def prefix(self, n: int) -> "MtpLayerOps":
        """These operators over the first n tokens only (exact for them: step t depends on tokens <= t)."""
        if n >= self.num_tokens:
            return self
        ops = self.copy()
        ops.embed, ops.hidden, ops.positions = self.embed[:n], self.hidden[:n], self.positions[:, :n]
        ops.token_ids = self.token_ids[:n]
        ops.rope = tuple(r[:, :n] for r in self.rope)
        ops.mask, ops.num_tokens = self.mask[:, :, :n, :n], n
        return ops

    @torch.inference_mode()
    def compute(self, name: str, s: dict[str, Tensor]) -> Tensor:
        if name == "e":  # vLLM's convention when mask_pos0: the embedding at absolute position 0 is zeroed first
            embed = self.embed.masked_fill((self.positions[0] == 0)[:, None], 0.0) if self.mask_pos0 else self.embed
            return self.enorm(embed)
        if name == "h":
            return self.hnorm(self.hidden)
        if name == "fc_in":
            return torch.cat([s[self.concat_order[0]], s[self.concat_order[1]]], dim=-1)
        if name == "fc":
            return self.eh_proj(s["fc_in"])
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
        if name in ("topk_ids", "topk_weights"):  # the official router's choice from the given logits
            _, weights, ids = _identity_router(self.mlp.gate)(s["router_logits"])
            return ids if name == "topk_ids" else weights
        if name == "shared":
            return self.mlp.shared_experts(s["mh"])
        if name == "routed":
            return self.mlp.experts(s["mh"], s["topk_ids"].long(), s["topk_weights"])
        if name == "mlp":  # DeepseekV3MoE / Glm4MoeMoE: experts(...) + shared_experts(residuals)
            return s["routed"] + s["shared"]
        if name == "res2":
            return s["res1"] + s["mlp"]
        if name == "out":
            return self.out_norm(s["res2"])
        raise KeyError(f"no operator for stage {name!r}")

    def replaced(self, path: tuple[str, ...], module) -> "MtpLayerOps":
        ops = self.copy()
        _set(ops, path, module)
        return ops


def explain_ops(head, rotary, inputs: TraceInputs, cfg) -> MtpLayerOps:
    return MtpLayerOps(head, rotary, inputs, cfg)


# ---- variants every MtpLayer family shares ----------------------------------------------------------------------------

def concat_swap(ops: MtpLayerOps) -> MtpLayerOps:
    ops = ops.copy()
    ops.concat_order = ("h", "e")
    return ops


def pre_norm_hidden(ops: MtpLayerOps) -> str:
    return ("needs the main model's pre-final-norm hidden, which a trace does not hold (it records the post-norm H "
            "the head consumes)")


def _has_pos0(ops: MtpLayerOps) -> bool:
    return bool((ops.positions == 0).any())


def pos0_mask_missing(ops: MtpLayerOps) -> "MtpLayerOps | str":
    if not ops.mask_pos0:
        return "the reference does not mask position 0 (mask_pos0_embedding off): see pos0_mask_extra"
    if not _has_pos0(ops):
        return "no step at absolute position 0: the mask changes nothing on these inputs"
    ops = ops.copy()
    ops.mask_pos0 = False
    return ops


def pos0_mask_extra(ops: MtpLayerOps) -> "MtpLayerOps | str":
    if ops.mask_pos0:
        return "the reference itself masks position 0 (mask_pos0_embedding on): see pos0_mask_missing"
    if not _has_pos0(ops):
        return "no step at absolute position 0: the mask changes nothing on these inputs"
    ops = ops.copy()
    ops.mask_pos0 = True
    return ops


def main_norm_for_out(ops: MtpLayerOps) -> "MtpLayerOps | str":
    ckpt = ops.checkpoint
    name = "model.norm.weight"
    if ckpt is None or name not in set(ckpt.names()):
        return f"the checkpoint has no {name} (the main model's final norm)"
    weight = torch.from_numpy(ckpt.read(name, (ops.cfg.hidden_size,)))
    if torch.equal(weight, ops.out_norm.weight.detach().float()):
        return f"{name} equals shared_head.norm.weight: the variant changes nothing"
    return ops.replaced(("out_norm",), _copy(ops.out_norm, weight=_param(weight)))


def embed_main_copy(ops: MtpLayerOps) -> "MtpLayerOps | str":
    ckpt = ops.checkpoint
    own = ops.cfg.head_prefix + "embed_tokens.weight"
    if ckpt is None or own not in set(ckpt.names()):
        return "the checkpoint has no MTP-layer embed_tokens copy: the reference uses the main embedding itself"
    rows = torch.from_numpy(ckpt.embedding_rows(ops.token_ids))
    if torch.equal(rows, ops.embed):
        return "the main embedding's rows equal the MTP layer's copy for these tokens: the variant changes nothing"
    ops = ops.copy()
    ops.embed = rows
    return ops


def _router(ops: MtpLayerOps, why_same: str | None, **attrs) -> "MtpLayerOps | str":
    if why_same:
        return why_same
    return ops.replaced(("mlp", "gate"), _copy(ops.mlp.gate, **attrs))


def no_correction_bias(ops: MtpLayerOps) -> "MtpLayerOps | str":
    bias = ops.mlp.gate.e_score_correction_bias
    return _router(ops, "e_score_correction_bias is zero: the variant changes nothing" if not bias.any() else None,
                   e_score_correction_bias=torch.zeros_like(bias))


def no_group_limit(ops: MtpLayerOps) -> "MtpLayerOps | str":
    """One group holding every expert, kept: the top-k runs over all experts (the group's top-2 sum is unused)."""
    gate = ops.mlp.gate
    never = gate.topk_group >= gate.num_group
    return _router(ops, f"n_group {gate.num_group}, topk_group {gate.topk_group}: the group limit never binds"
                   if never else None, num_group=1, topk_group=1)


def not_renormalised(ops: MtpLayerOps) -> "MtpLayerOps | str":
    gate = ops.mlp.gate
    return _router(ops, None if gate.norm_topk_prob else "the reference itself does not renormalise "
                   "(norm_topk_prob false)", norm_topk_prob=False)


def no_routed_scaling(ops: MtpLayerOps) -> "MtpLayerOps | str":
    gate = ops.mlp.gate
    return _router(ops, "routed_scaling_factor is 1: the variant changes nothing"
                   if gate.routed_scaling_factor == 1 else None, routed_scaling_factor=1.0)


def shared_scaled(ops: MtpLayerOps) -> "MtpLayerOps | str":
    """The shared experts' output times routed_scaling_factor: their down_proj weight scaled (one float32 rounding
    per element, far below any tolerance)."""
    factor = ops.mlp.gate.routed_scaling_factor
    if factor == 1:
        return "routed_scaling_factor is 1: the variant changes nothing"
    down = ops.mlp.shared_experts.down_proj
    weight = down.value() if isinstance(down, Fp8Linear) else down.weight.detach().float()  # its .weight: bytes
    return ops.replaced(("mlp", "shared_experts", "down_proj"), UpcastLinear(weight * factor))


class _SwappedHalves:
    """Stands in for the experts' gate_up_proj: expert e's [up; gate] instead of [gate; up]."""

    def __init__(self, widened):
        self.widened = widened

    def __getitem__(self, index) -> Tensor:
        w = self.widened[index]
        half = w.shape[0] // 2
        return torch.cat([w[half:], w[:half]])


def gate_up_swap(ops: MtpLayerOps) -> MtpLayerOps:
    """The routed experts with gate and up swapped (the shared experts as released: a separate MLP)."""
    experts = _copy(ops.mlp.experts)
    object.__setattr__(experts, "gate_up_proj", _SwappedHalves(ops.mlp.experts.gate_up_proj))
    return ops.replaced(("mlp", "experts"), experts)


def fp8_scale_transposed(ops: MtpLayerOps) -> "MtpLayerOps | str":
    """Every FP8 weight whose block-scale grid is square (and more than one block) dequantized with the grid
    transposed, W[r, c] = q[r, c] * s[c // bi, r // bo]; a non-square grid cannot be indexed that way without
    reading outside it, so those are left as they are (the definition tests/families/test_deepseek_glm.py uses)."""
    found = routed_experts_of(ops.head)
    fp8: Fp8Weights | None = found[0].fp8 if found and isinstance(found[0], RoutedFp8Experts) else None
    if fp8 is None or not fp8.fp8:
        return "the checkpoint has no FP8 weights"
    weights = dict(fp8.weights)
    changed = set()
    for name in fp8.fp8:
        scale = weights[name.removesuffix("weight") + _SCALE]
        if scale.dim() == 2 and scale.shape[0] == scale.shape[1] > 1:
            weights[name.removesuffix("weight") + _SCALE] = scale.T.contiguous()
            changed.add(name)
    if not changed:
        return "no FP8 weight has a square block-scale grid of more than one block: a transposed index changes nothing"
    patched = Fp8Weights(weights, fp8.block)
    ops = ops.copy()
    for name in sorted(changed):
        if name in ops.owners:
            path, leaf = ops.owners[name]
            _set(ops, path + (leaf,), UpcastLinear(patched.value(name)))
    routed = found[0]
    if any(routed.owns(n) for n in changed):
        widened = RoutedFp8Experts(routed.layout, weights, patched)
        experts = _copy(ops.mlp.experts)
        object.__setattr__(experts, "gate_up_proj", _Widened(widened, "gate_up"))
        object.__setattr__(experts, "down_proj", _Widened(widened, "down"))
        _set(ops, ("mlp", "experts"), experts)
    return ops


def pos_frozen(ops: MtpLayerOps) -> MtpLayerOps:
    ops = ops.copy()
    ops.rope = ops.rotary(ops.embed[None], ops.positions[:, :1].expand_as(ops.positions))
    return ops


def bias_in_weights(ops: MtpLayerOps) -> str:
    return ("not expressible as a patch of the official router's modules or weights: it gathers the weights from "
            "the unbiased scores inside its forward")


COMMON = {
    "concat_swap": ("fc_in", concat_swap), "pre_norm_hidden": ("h", pre_norm_hidden),
    "main_norm_for_out": ("out", main_norm_for_out), "pos0_mask_missing": ("e", pos0_mask_missing),
    "pos0_mask_extra": ("e", pos0_mask_extra), "embed_main_copy": ("e", embed_main_copy),
    "bias_in_weights": ("topk_weights", bias_in_weights), "no_correction_bias": ("topk_ids", no_correction_bias),
    "no_group_limit": ("topk_ids", no_group_limit), "not_renormalised": ("topk_ids", not_renormalised),
    "no_routed_scaling": ("topk_ids", no_routed_scaling), "shared_scaled": ("shared", shared_scaled),
    "gate_up_swap": ("routed", gate_up_swap), "fp8_scale_transposed": ("fc", fp8_scale_transposed),
    "pos_frozen": ("attn", pos_frozen),
}
