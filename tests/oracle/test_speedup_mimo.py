"""The draft step's KV-cache term per MTP layer (oracle/speedup.py head_window, head_kv_values_per_token): MiMo's
MTP layers are SWA attention with their own KV heads and dims (swa_num_key_value_heads, swa_head_dim,
swa_v_head_dim) and window (sliding_window_size + 1 keys), not the main model's full-attention ones; each layer's
cache then holds the last W tokens. Twins: a full-attention layer (Step-3.7's layer 0) counts every token, and a
MiMo context shorter than the window counts only the tokens there are. Each figure by hand from config.json."""

import json

import pytest

from oracle.checkpoint import Checkpoint
from oracle.speedup import draft_steps, head_kv_values_per_token, head_window
from tests.helpers import FIXTURES

MIMO = FIXTURES / "mimo_v2_flash_tiny"
STEP = FIXTURES / "step3p7_tiny"
BF16 = 2


def _kv_term(terms) -> tuple[str, float]:
    return next((k, v) for k, v in terms.bytes.items() if k.startswith("head KV cache"))


def test_mimo_layers_cache_their_own_swa_heads_for_their_window():
    raw = json.loads((MIMO / "config.json").read_text())
    window = raw["sliding_window_size"] + 1  # transformers' reading: the previous W-1 tokens plus the query
    per_token = raw["swa_num_key_value_heads"] * (raw["swa_head_dim"] + raw["swa_v_head_dim"])
    main_per_token = 2 * raw["num_key_value_heads"] * raw["head_dim"]  # the main full-attention layers' K and V
    assert per_token != main_per_token  # the fixture tells the two apart
    ckpt = Checkpoint(MIMO)
    assert head_kv_values_per_token(ckpt) == per_token
    steps = draft_steps(ckpt, "lm_head.weight", context=40, depth=raw["num_nextn_predict_layers"])
    assert len(steps) == 3
    for layer, terms in enumerate(steps):
        assert head_window(ckpt, layer) == window
        assert _kv_term(terms) == (f"head KV cache at 40 tokens (sliding window: {window})",
                                   pytest.approx(BF16 * per_token * window, rel=1e-12))


def test_twin_a_full_attention_layer_counts_every_token():
    """Step-3.7's tiny head: layer 0 full attention (every one of the 40 tokens), layer 1 sliding (its W)."""
    raw = json.loads((STEP / "config.json").read_text())["text_config"]
    per_token = 2 * raw["num_key_value_heads"] * raw["head_dim"]
    ckpt = Checkpoint(STEP)
    full, sliding, _ = draft_steps(ckpt, "lm_head.weight", context=40, depth=3)
    assert head_window(ckpt, 0) is None
    assert _kv_term(full) == ("head KV cache at 40 tokens", pytest.approx(BF16 * per_token * 40, rel=1e-12))
    assert _kv_term(sliding) == (f"head KV cache at 40 tokens (sliding window: {raw['sliding_window']})",
                                 pytest.approx(BF16 * per_token * raw["sliding_window"], rel=1e-12))


def test_twin_a_mimo_context_shorter_than_the_window_counts_its_tokens():
    raw = json.loads((MIMO / "config.json").read_text())
    per_token = raw["swa_num_key_value_heads"] * (raw["swa_head_dim"] + raw["swa_v_head_dim"])
    (terms,) = draft_steps(Checkpoint(MIMO), "lm_head.weight", context=3, depth=1)
    assert _kv_term(terms) == ("head KV cache at 3 tokens", pytest.approx(BF16 * per_token * 3, rel=1e-12))
