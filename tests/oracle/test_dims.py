"""The oracle on checkpoints that are not the fixtures: other head counts, one KV head, other theta, shards."""

import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.cli import cli
from oracle.stages import STAGE_NAMES
from oracle.trace import read_trace
from tests.helpers import run_cli
from tests.oracle.test_head import official_layer_stages, rel_err

VARIANTS = {
    "one_kv_head": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "hidden_size": 48,
                    "rope_theta": 1e6, "mrope_section": [1, 1, 0]},
    "six_heads_half_rotary": {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 24,
                              "hidden_size": 48, "intermediate_size": 80, "partial_rotary_factor": 0.5,
                              "mrope_section": [2, 2, 2]},
    "mqa_eight_heads": {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8, "hidden_size": 32,
                        "rope_theta": 5e6, "mrope_section": [1, 0, 0], "rms_norm_eps": 1e-5},
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_matches_official_layer_on_other_dims(tmp_path, make_fixtures, variant, sharded):
    ckpt_dir = make_fixtures.write_checkpoint(tmp_path / variant, VARIANTS[variant], seed=3, sharded=sharded)
    out = tmp_path / "ref.h5"
    result = run_cli(cli, ["export", ckpt_dir, "--out", out, "--tokens", "9,400,3,77,1,250", "--start-pos", "5",
                           "--hidden-seed", "4", "-q"])
    assert result.exit_code == 0, result.output
    ckpt = Checkpoint(ckpt_dir)
    with read_trace(out) as trace:
        assert trace.hidden_size == VARIANTS[variant]["hidden_size"] and trace.stages == (*STAGE_NAMES, "draft")
        stages = {n: trace.stage_rows(n) for n in trace.stages}
        positions = trace.input_rows("positions")
    np.testing.assert_array_equal(positions, np.arange(5, 11))
    lm_head = ckpt.read("lm_head.weight").astype(np.float64)
    np.testing.assert_array_equal(stages.pop("draft")[:, 0], (stages["out"].astype(np.float64) @ lm_head.T).argmax(1))
    official = official_layer_stages(ckpt, stages["fc"], positions)
    for name, expected in official.items():
        assert rel_err(stages[name], expected) <= 1e-6, name
