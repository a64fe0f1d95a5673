"""`mtp-probe run` drives a Python candidate's own draft loop (issue 24): bridge i, its chain, bridge i+1, with no
hidden handed to a draft step. The example numpy head passes at every depth; engine-shaped loop bugs (a chain's KV
rows kept, res2 recycled, a frozen chain position) are caught at the right (depth, stage, bridge); an impl that
says it drafts but never writes a depth is invalid; one without draft_step is inconclusive."""

import textwrap

import pytest

from probe.cli import cli
from tests.helpers import FIXTURES, TINY, run_cli
from tests.probe.tracekit import last_line

MUTANTS = textwrap.dedent('''
    import numpy as np
    from numpy_step import NumpyHead


    class KeepsChainKv(NumpyHead):
        def step(self, pos, embed_row, hidden, out, trace):  # never drops the chain's rows
            self.forward(pos, embed_row, hidden, out, trace)


    class RecyclesPrenorm(NumpyHead):
        def forward(self, pos, embed_row, hidden, out, trace):
            trace = dict(trace)
            res2 = trace.setdefault("res2", np.empty_like(out))
            super().forward(pos, embed_row, hidden, out, trace)
            self.recycled = np.array(res2, dtype=np.float32)


    class FrozenPosition(NumpyHead):
        def step(self, pos, embed_row, hidden, out, trace):
            self.bridge_pos = pos
            super().step(pos, embed_row, hidden, out, trace)

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            super().draft_step(depth, token, self.bridge_pos, embed_row, out, trace)


    class NeverWritesDepthThree(NumpyHead):
        def draft_step(self, depth, token, pos, embed_row, out, trace):
            if depth != 3:
                super().draft_step(depth, token, pos, embed_row, out, trace)


    class NoLoop(NumpyHead):
        draft_step = None


    def make(name):
        return lambda config, weights: globals()[name](config, weights)


    keeps_kv, prenorm, frozen, never_three, no_loop = (make(n) for n in (
        "KeepsChainKv", "RecyclesPrenorm", "FrozenPosition", "NeverWritesDepthThree", "NoLoop"))
''')


@pytest.fixture
def mutants(tmp_path, monkeypatch):
    (tmp_path / "loop_mutants.py").write_text(MUTANTS)
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    monkeypatch.syspath_prepend(str(tmp_path))


def _run(ref, spec):
    return run_cli(cli, ["run", ref, "--impl", spec, "--checkpoint", TINY, "-q"])


def test_correct_loop_passes_at_every_depth(chained, mutants):
    result = _run(chained[0], "python:numpy_step:make_head")
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 11 stages x 10 tokens within tolerance at depths 1-4")


@pytest.mark.parametrize("factory, where", [
    ("keeps_kv", "first divergent stage: attn at token 1"),  # bridge 1 attends to bridge 0's chain rows
    ("prenorm", "first divergent stage: h at depth 2 bridge 0"),
    ("frozen", "first divergent stage: attn at depth 2 bridge 0"),
])
def test_loop_bugs_are_caught_where_they_start(chained, mutants, factory, where):
    result = _run(chained[0], f"python:loop_mutants:{factory}")
    assert result.exit_code == 1, result.output
    assert where in last_line(result)


def test_a_depth_never_written_is_invalid(chained, mutants):
    result = _run(chained[0], "python:loop_mutants:never_three")
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("INVALID | depth 3: unwritten rows")


def test_no_draft_step_is_inconclusive(chained, mutants):
    result = _run(chained[0], "python:loop_mutants:no_loop")
    assert result.exit_code == 3, result.output
    assert "the draft loop was not checked" in last_line(result)


# --- C ABI v2: mtp2_draft_step, detected by symbol --------------------------------------------------------------

@pytest.fixture(scope="module")
def v2_library(tmp_path_factory):
    from probe.adapters.cabi import build_library

    out = tmp_path_factory.mktemp("v2-chain")
    return lambda *defines: build_library(FIXTURES / "candidates" / "mtp_step_v2.c", out, defines)


def test_c_draft_step_passes_at_every_depth(chained, v2_library):
    result = _run(chained[0], f"c:{v2_library()}")
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith("PASSED | 11 stages x 10 tokens within tolerance at depths 1-4")


def test_c_frozen_chain_position_is_caught_at_depth_two(chained, v2_library):
    result = _run(chained[0], f"c:{v2_library('MTP_MUTANT_CHAIN_POS_FROZEN')}")
    assert result.exit_code == 1, result.output
    assert "first divergent stage: attn at depth 2 bridge 0" in last_line(result)


def test_c_library_that_drafts_but_never_writes_is_invalid(chained, v2_library):
    result = _run(chained[0], f"c:{v2_library('MTP_MUTANT_DRAFT_NO_WRITE')}")
    assert result.exit_code == 2, result.output
    assert last_line(result).startswith("INVALID | depth 2: unwritten rows")


def test_v2_library_without_draft_step_still_runs_and_says_the_loop_was_not_checked(chained, v2_library):
    library = v2_library("MTP_NO_DRAFT_STEP")
    result = _run(chained[0], f"c:{library}")
    assert result.exit_code == 3 and "the draft loop was not checked" in last_line(result), result.output
    from tests.helpers import TINY_REF

    old = run_cli(cli, ["run", TINY_REF, "--impl", f"c:{library}", "-q"])  # a reference without chains: as before
    assert old.exit_code == 0 and last_line(old).startswith("PASSED | 11 stages x 8 tokens"), old.output


def test_v1_library_on_a_chain_reference_is_inconclusive(chained, tmp_path):
    from probe.adapters.cabi import build_library

    library = build_library(FIXTURES / "candidates" / "mtp_step.c", tmp_path)
    result = _run(chained[0], f"c:{library}")
    assert result.exit_code == 3 and "the draft loop was not checked" in last_line(result), result.output
