"""DeepSeek-V3 / R1 / V3.1 (`deepseek_v3`) MTP head, torch-free half: config parsing, tensor names and shapes,
stages, evidence rules, known wiring variants and a tiny config. The head, from transformers' own `MtpLayer` with
`DeepseekV3DecoderLayer`, is `oracle/families/deepseek_v3.py`; the layout shared with GLM-4.5 is
`oracle/families/mtp_layer_layout.py`; this file declares only what DeepSeek-V3 adds (MLA's fields and tensors).

Attention is MLA (shared/reference/mtp_wiring.md §3.3): with `q_lora_rank`, q = q_b_proj(q_a_layernorm(q_a_proj(x)));
without it (q_lora_rank null, as in V2-Lite-shaped models), q = q_proj(x). kv_a_proj_with_mqa gives the kv latent
(kv_lora_rank, normed by kv_a_layernorm) and one shared rope key (qk_rope_head_dim); kv_b_proj expands the latent to
per-head k_nope and v. RoPE covers only the qk_rope_head_dim dims, on interleaved pairs (`rope_interleave`, true as
released); YaRN (`rope_scaling.type = yarn`) scales the inverse frequencies and multiplies the softmax scale by
mscale(factor, mscale_all_dim)^2. The latent norms use eps 1e-6 whatever rms_norm_eps says (as transformers' and
DeepSeek's own code build them).
"""

from dataclasses import dataclass

from oracle.errors import CheckpointError
from oracle.families import mtp_layer_layout as common
from oracle.families.mtp_layer_layout import MtpLayerConfig, MtpLayerFamily
from oracle.families.spec import Variant

FAMILY = "deepseek_v3"
MODEL_TYPES = ("deepseek_v3",)
# transformers' DeepseekV3Config defaults for fields a config.json may omit (they equal V3's)
DEFAULTS = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8,
            "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}


@dataclass(frozen=True, kw_only=True)
class HeadConfig(MtpLayerConfig):
    q_lora_rank: int | None  # None: q_proj straight from the hidden
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:  # per-head width for memory estimates (oracle/limits.py)
        return max(self.qk_head_dim, self.v_head_dim)


def attention_fields(raw: dict, source: str, fields: dict) -> dict:
    """MLA's fields (q_lora_rank null: q_proj straight from the hidden); YaRN or default rope."""
    common.require(raw, "attention_bias", False, source)
    q_lora = raw.get("q_lora_rank")
    if fields["num_key_value_heads"] != fields["num_attention_heads"]:
        # MLA's kv_b_proj makes keys and values for every attention head; transformers' DeepseekV3Attention would
        # still repeat them num_attention_heads / num_key_value_heads times and fail on the shapes
        raise CheckpointError(f"{source}: num_key_value_heads {fields['num_key_value_heads']} differs from "
                              f"num_attention_heads {fields['num_attention_heads']}; DeepSeek-V3's attention (MLA) "
                              f"has keys and values per attention head (V3 sets both to 128). Set "
                              f"num_key_value_heads to num_attention_heads.")
    return {"rope_parameters": common.rope_parameters(raw, source, ("default", "yarn"), None),
            "q_lora_rank": None if q_lora is None else common.positive_int(raw, "q_lora_rank", source),
            "kv_lora_rank": common.positive_int(raw, "kv_lora_rank", source),
            "qk_nope_head_dim": common.positive_int(raw, "qk_nope_head_dim", source),
            "qk_rope_head_dim": _even(common.positive_int(raw, "qk_rope_head_dim", source), source),
            "v_head_dim": common.positive_int(raw, "v_head_dim", source),
            "rope_interleave": common.boolean(raw, "rope_interleave", source, True)}


def _even(n: int, source: str) -> int:
    if n % 2:
        raise CheckpointError(f"{source}: qk_rope_head_dim {n} must be even (RoPE rotates pairs).")
    return n


def attention_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """MLA's tensors under self_attn. ([out, in] for linears)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    shapes = {"kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
              "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
              "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              "o_proj.weight": (d, h * cfg.v_head_dim)}
    if cfg.q_lora_rank is None:
        return shapes | {"q_proj.weight": (h * cfg.qk_head_dim, d)}
    return shapes | {"q_a_proj.weight": (cfg.q_lora_rank, d), "q_a_layernorm.weight": (cfg.q_lora_rank,),
                     "q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank)}


def tiny_config(**overrides) -> dict:
    """A config.json for a tiny DeepSeek-V3 (fixtures and the family contract test): MLA with q_lora, YaRN."""
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "n_shared_experts": 1, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
              "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
              "scoring_func": "sigmoid", "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 48,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "hidden_act": "silu", "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "vocab_size": 512,
              "rope_theta": 10000, "attention_bias": False, "tie_word_embeddings": False,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    config.update(overrides)
    return config


SPEC = common.declare(MtpLayerFamily(
    FAMILY, MODEL_TYPES, ("DeepseekV3ForCausalLM",), HeadConfig, DEFAULTS, attention_fields, attention_shapes,
    tiny_config, engine_mtp="deepseek_mtp",
    variants=(Variant("rope_not_interleaved", "MLA RoPE on NeoX halves instead of interleaved pairs"),
              Variant("no_yarn_mscale", "softmax scale without YaRN's mscale^2"),
              Variant("latent_norm_eps", "q_a_layernorm/kv_a_layernorm with rms_norm_eps instead of 1e-6"))))
