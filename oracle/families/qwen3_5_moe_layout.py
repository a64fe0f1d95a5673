"""Qwen3.5-MoE (`qwen3_5_moe`) MTP head, torch-free half: a declaration over the Qwen stem and its sparse MoE block
(oracle/families/qwen3_5_layout.py: router, top-k, routed experts per expert or fused, a shared expert behind a
sigmoid gate). The head itself is `oracle/families/qwen3_5_moe.py`.

Top-k renormalisation: transformers' Qwen3_5MoeTopKRouter always renormalises the top-k weights to sum 1, and the
release config has no `norm_topk_prob` key; engines read `norm_topk_prob`. The oracle follows the config when it
has the key and transformers (true) otherwise, records the value in the trace's config, and
`mtp-oracle export --norm-topk-prob/--no-norm-topk-prob` overrides it.
"""

from oracle.families.qwen3_5_layout import MAIN_MODEL_PREFIXES, moe_spec


def tiny_config(**overrides) -> dict:
    text = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 40, "num_hidden_layers": 1, "layer_types": ["full_attention"],
            "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    text.update(overrides)
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text}


SPEC = moe_spec(
    "qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    main_model_prefixes=MAIN_MODEL_PREFIXES, mrope=True, tiny_config=tiny_config,
    notes=("norm_topk_prob: transformers' Qwen3_5MoeTopKRouter always renormalises; the oracle follows the config's "
           "norm_topk_prob when present, else true (recorded in config)",),
)
