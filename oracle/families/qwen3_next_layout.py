"""Qwen3-Next (`qwen3_next`) MTP head, torch-free half: a declaration over the Qwen stem and its sparse MoE block
(oracle/families/qwen3_5_layout.py), with gated attention under plain partial RoPE (no mrope); `norm_topk_prob` is
read by transformers' own router. The head itself is `oracle/families/qwen3_next.py`. Released checkpoints use
per-expert names; fused ones are accepted too."""

from oracle.families.qwen3_5_layout import moe_spec


def tiny_config(**overrides) -> dict:
    config = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
              "intermediate_size": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 1,
              "layer_types": ["full_attention"], "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25}}
    config.update(overrides)
    return config


SPEC = moe_spec("qwen3_next", ("qwen3_next",), architectures=("Qwen3NextForCausalLM",),
                main_model_prefixes=("model.",), mrope=False, tiny_config=tiny_config)
