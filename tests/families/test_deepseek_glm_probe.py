"""What the probe says about DeepSeek-V3 traces: the family's own evidence rules reach the report (position 0 is
observable only with the embedding mask on; how many tokens' routing depended on the group limit)."""

from oracle.cli import cli as oracle_cli
from probe.cli import cli as probe_cli
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")


def _export(tmp_path, *extra):
    ckpt = FIXTURES.write_mtp_layer_checkpoint(tmp_path / "ckpt", "deepseek_v3")
    out = tmp_path / f"ref{len(extra)}.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", "5,17,3,99,200,7", "--hidden-seed", "0",
                                  "-q", *extra])
    assert result.exit_code == 0, result.output
    return out


def test_with_the_position_0_mask_the_report_says_position_0_is_observable(tmp_path):
    masked = run_cli(probe_cli, ["diff", _export(tmp_path, "--mask-pos0-embedding"), tmp_path / "ref1.h5"])
    assert "position 0 observable" in masked.output
    assert "absolute positions are not evidenced by a self-contained trace" not in masked.output
    plain = run_cli(probe_cli, ["diff", _export(tmp_path), tmp_path / "ref0.h5"])  # twin: mask off
    assert "absolute positions are not evidenced" in plain.output and "position 0 observable" not in plain.output


def test_the_report_counts_the_tokens_whose_routing_depended_on_the_group_limit(tmp_path):
    ref = _export(tmp_path)
    result = run_cli(probe_cli, ["diff", ref, ref])
    assert "tokens had a routing decision that depended on the group limit" in result.output
