"""GLM-4.5 / 4.6 (`glm4_moe`) MTP head, torch-free half: config parsing, tensor names and shapes, stages, evidence
rules, known wiring variants and a tiny config. The head, from transformers' own `MtpLayer` with
`Glm4MoeDecoderLayer`, is `oracle/families/glm4_moe.py`; the layout shared with DeepSeek-V3 is
`oracle/families/mtp_layer_layout.py`; this file declares only what GLM-4.5 adds (GQA's fields and tensors).

Attention is GQA (shared/reference/mtp_wiring.md §3.4): q/k/v projections with a bias when `attention_bias`,
optional per-head q/k RMSNorm (`use_qk_norm`) applied before RoPE, partial NeoX RoPE on the first
int(head_dim * partial_rotary_factor) dims (transformers' default factor for glm4_moe is 0.5), o_proj without
bias. The MoE block is DeepSeek's noaux_tc router (GLM-4.5: n_group 1, topk_group 1).
"""

from dataclasses import dataclass

from oracle.errors import CheckpointError
from oracle.families import mtp_layer_layout as common
from oracle.families.mtp_layer_layout import MtpLayerConfig, MtpLayerFamily
from oracle.families.spec import Variant

FAMILY = "glm4_moe"
MODEL_TYPES = ("glm4_moe",)
# transformers' Glm4MoeConfig defaults for fields a config.json may omit
DEFAULTS = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "n_routed_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1, "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "num_key_value_heads": 8}


@dataclass(frozen=True, kw_only=True)
class HeadConfig(MtpLayerConfig):
    head_dim: int
    partial_rotary_factor: float
    use_qk_norm: bool
    attention_bias: bool

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def attention_fields(raw: dict, source: str, fields: dict) -> dict:
    """GQA's fields: head_dim, partial NeoX rotary (factor from rope_parameters, else the top level, else 0.5),
    q/k norm, q/k/v bias."""
    rope_in = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = common.positive_number({"f": rope_in.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))},
                                    "f", source)
    head_dim = common.positive_int(raw, "head_dim", source, fields["hidden_size"] // fields["num_attention_heads"])
    rotary_dim = int(head_dim * factor)  # HeadConfig.rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(f"{source}: head_dim {head_dim} x partial_rotary_factor {factor} gives rotary dim "
                              f"{rotary_dim}; it must be even and in 2..head_dim.")
    return {"rope_parameters": common.rope_parameters(raw, source, ("default",), factor), "head_dim": head_dim,
            "partial_rotary_factor": factor, "use_qk_norm": common.boolean(raw, "use_qk_norm", source, False),
            "attention_bias": common.boolean(raw, "attention_bias", source, False)}


def attention_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d), "o_proj.weight": (d, q)}
    if cfg.attention_bias:
        shapes |= {"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
    if cfg.use_qk_norm:
        shapes |= {"q_norm.weight": (hd,), "k_norm.weight": (hd,)}
    return shapes


def tiny_config(**overrides) -> dict:
    """A config.json for a tiny GLM-4.5 (fixtures and the family contract test): GQA, qk-norm, qkv bias, partial
    rotary 0.5, head_dim != hidden / heads."""
    config = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
              "partial_rotary_factor": 0.5, "n_shared_experts": 1, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
              "norm_topk_prob": True, "first_k_dense_replace": 1, "hidden_act": "silu",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 1000000.0,
              "attention_bias": True, "use_qk_norm": True, "tie_word_embeddings": False}
    config.update(overrides)
    return config


SPEC = common.declare(MtpLayerFamily(
    FAMILY, MODEL_TYPES, ("Glm4MoeForCausalLM",), HeadConfig, DEFAULTS, attention_fields, attention_shapes,
    tiny_config, engine_mtp="glm4_moe_mtp",
    variants=(Variant("rope_all_dims", "RoPE over the whole head instead of its partial rotary dims"),
              Variant("qk_norm_after_rope", "q_norm/k_norm applied after RoPE instead of before"),
              Variant("no_qkv_bias", "q/k/v projection biases dropped"))))
