"""Traces written before model families (mtp-trace/1, Qwen3.5 dense, no stage metadata, no evidence records)
still read unchanged: the default stage list, float rows, and an honest best verdict of inconclusive (their q/k
evidence was never measured)."""

from oracle.stages import STAGE_NAMES
from oracle.trace import read_trace
from probe.cli import cli
from tests.helpers import FIXTURES, TINY, TINY_REF, run_cli

LEGACY = FIXTURES / "legacy" / "qwen3_5_tiny_ref_before_families.h5"


def test_a_trace_from_before_families_reads_with_the_default_stage_list():
    with read_trace(LEGACY) as trace:
        assert "family" in trace.attrs and "dims" not in trace.attrs and not trace.has_evidence("attn_uniform")
        assert trace.stages == STAGE_NAMES
        assert [s.kind for s in trace.stage_list] == ["rows"] * len(STAGE_NAMES)
        assert trace.stage_list["ah"].doc  # the meaning comes from the default list


def test_it_serves_as_a_reference_but_cannot_pass_without_measured_q_k_evidence():
    result = run_cli(cli, ["run", LEGACY, "--impl", "torch", "--checkpoint", TINY])
    assert result.exit_code == 3 and "re-export the reference" in result.output
    fresh = run_cli(cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", TINY])  # twin: a current reference
    assert fresh.exit_code == 0, fresh.output
