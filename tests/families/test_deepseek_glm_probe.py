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


def test_with_the_mask_but_no_step_at_position_0_position_0_is_not_claimed_observable(tmp_path):
    """--start-pos 5: no step sits at position 0, so the mask zeroes nothing and an unmasked (or shifted) candidate
    matches; the report must not say it would differ at e. Twin: the same export from position 0 says it."""
    masked = _export(tmp_path, "--mask-pos0-embedding", "--start-pos", "5")
    (tmp_path / "masked.h5").write_bytes(masked.read_bytes())
    unmasked = _export(tmp_path, "--start-pos", "5")  # the candidate: no mask at all
    result = run_cli(probe_cli, ["diff", tmp_path / "masked.h5", unmasked])
    assert result.exit_code in (0, 3), result.output  # it matches: nothing there could tell the mask
    assert "position 0 observable" not in result.output
    assert "no step of this trace sits at absolute position 0" in result.output
    from_zero = _export(tmp_path, "--mask-pos0-embedding", "--start-pos", "0")
    assert "position 0 observable" in run_cli(probe_cli, ["diff", from_zero, from_zero]).output


def test_every_masking_family_claims_position_0_only_with_a_step_there():
    import dataclasses

    import numpy as np

    from oracle.families.registry import FAMILIES

    masking = [f for f in FAMILIES.values() if f.tiny_config is not None
               and "mask_pos0_embedding" in {x.name for x in dataclasses.fields(f.parse_config(f.tiny_config(), "-"))}]
    assert {f.name for f in masking} >= {"deepseek_v3", "glm4_moe", "deepseek_v4"}
    for family in masking:
        cfg = dataclasses.replace(family.parse_config(family.tiny_config(), "-"), mask_pos0_embedding=True)
        at_zero = family.evidence_rules(cfg, np.arange(0, 6))["absolute_positions"]
        later = family.evidence_rules(cfg, np.arange(5, 11))["absolute_positions"]
        assert at_zero.startswith("position 0 observable"), family.name
        assert "position 0 observable" not in later and "no step of this trace sits at absolute position 0" in later
