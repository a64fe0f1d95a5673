"""The benchmarks' Step-3.7-Flash-shaped head (scripts/make_realscale_step3p7_checkpoint.py) stores its sliding MTP
layers with the release's 96 heads (attention_other_setting), as vLLM's step3p5_mtp builds them; the oracle builds
exactly those shapes from the real dims' config (on the meta device: no weights), and, as its twin shows, would
not without reading the stored count (transformers' MtpModel alone builds 64)."""

import pytest
import torch

from oracle.families.mtp_model import MtpModelHead, sliding_heads_as_stored
from oracle.families.registry import family
from tests.helpers import load_script

GENERATOR = load_script("make_realscale_step3p7_checkpoint")
PARTS = ("q_proj", "g_proj", "o_proj")


@pytest.fixture(scope="module")
def release():
    cfg = family("step3p7").parse_config(GENERATOR.config(None), "config.json")
    stored = {name: torch.empty(shape, device="meta") for layer in range(cfg.num_mtp_layers)
              for name, (_, shape) in GENERATOR.layer_tensors(cfg.num_hidden_layers + layer, None).items()}
    return cfg, stored


def _built(head: MtpModelHead, layer: int, part: str) -> tuple[int, ...]:
    return tuple(getattr(head.mtp.layers[layer].mtp_block.self_attn, part).weight.shape)


def _stored(cfg, stored, layer: int, part: str) -> tuple[int, ...]:
    return tuple(stored[cfg.layer_prefix(layer) + f"self_attn.{part}.weight"].shape)


def test_the_oracle_builds_the_release_shapes_of_every_sliding_mtp_layer(release):
    cfg, stored = release
    head = MtpModelHead(sliding_heads_as_stored(cfg, stored))
    for layer in range(cfg.num_mtp_layers):
        assert _stored(cfg, stored, layer, "q_proj") == (96 * 128, 4096)
        assert all(_built(head, layer, p) == _stored(cfg, stored, layer, p) for p in PARTS), layer


def test_twin_from_config_json_alone_the_mtp_layers_get_64_heads(release):
    cfg, stored = release
    head = MtpModelHead(cfg)
    assert all(_built(head, layer, "q_proj") == (64 * 128, 4096) for layer in range(cfg.num_mtp_layers))
