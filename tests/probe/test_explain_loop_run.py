"""`mtp-probe run --explain` on driven draft loops (issue 24): the engine runs its own loop (bridge i, its chain,
bridge i+1; no hidden handed to a draft step), and DIAGNOSIS names the loop variant it has.

Candidates: the example numpy head (fixtures/candidates/numpy_step.py, an independent float64 numpy port) with one
loop bug each, through the Python contract, and the C ABI v2 library's frozen-chain-position mutant
(fixtures/candidates/mtp_step_v2.c). Twin: the correct loop passes, no DIAGNOSIS of any variant."""

import json
import textwrap

import pytest

from probe.adapters.cabi import build_library
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


    class RecyclesMain(NumpyHead):
        def step(self, pos, embed_row, hidden, out, trace):
            self.main = np.array(hidden, dtype=np.float32)
            super().step(pos, embed_row, hidden, out, trace)

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            self.forward(pos, embed_row, self.main, out, trace)


    class FrozenPosition(NumpyHead):
        def step(self, pos, embed_row, hidden, out, trace):
            self.bridge_pos = pos
            super().step(pos, embed_row, hidden, out, trace)

        def draft_step(self, depth, token, pos, embed_row, out, trace):
            super().draft_step(depth, token, self.bridge_pos, embed_row, out, trace)


    class SwapsNorms(NumpyHead):
        def __init__(self, cfg, weights):
            super().__init__(cfg, weights)
            w = self.w
            w["pre_fc_norm_embedding.weight"], w["pre_fc_norm_hidden.weight"] = (w["pre_fc_norm_hidden.weight"],
                                                                                  w["pre_fc_norm_embedding.weight"])


    def make(name):
        return lambda config, weights: globals()[name](config, weights)


    keeps_kv, prenorm, main, frozen, swapped = (make(n) for n in (
        "KeepsChainKv", "RecyclesPrenorm", "RecyclesMain", "FrozenPosition", "SwapsNorms"))
''')


@pytest.fixture
def mutants(tmp_path, monkeypatch):
    (tmp_path / "loop_mutants.py").write_text(MUTANTS)
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    monkeypatch.syspath_prepend(str(tmp_path))


def _explained(ref, spec, tmp_path):
    result = run_cli(cli, ["run", ref, "--impl", spec, "--checkpoint", TINY, "--explain", "--json",
                           tmp_path / "r.json"])
    report = json.loads((tmp_path / "r.json").read_text())["explain"]
    return result, [d["variant"] for d in report["diagnosis"]]


def _diagnosis(result) -> str:
    return next(line for line in result.output.splitlines() if line.startswith("DIAGNOSIS"))


@pytest.mark.parametrize("factory, where, variant", [
    ("keeps_kv", "attn at token 1", "chain_kv_kept"),  # bridge 1 attends to bridge 0's chain rows
    ("prenorm", "h at depth 2 bridge 0", "recycle_prenorm"),
    ("main", "h at depth 2 bridge 0", "recycle_main_hidden"),
    ("frozen", "attn at depth 2 bridge 0", "position_frozen"),
    ("swapped", "e at token 0", "enorm_hnorm_swap"),
])
def test_python_loop_bugs_are_named(chained, mutants, tmp_path, factory, where, variant):
    result, named = _explained(chained[0], f"python:loop_mutants:{factory}", tmp_path)
    assert result.exit_code == 1, result.output
    assert f"first divergent stage: {where}" in last_line(result), result.output
    assert named[:1] == [variant], _diagnosis(result)


def test_twin_python_correct_loop_gets_no_diagnosis(chained, mutants, tmp_path):
    result, named = _explained(chained[0], "python:numpy_step:make_head", tmp_path)
    assert result.exit_code == 0, result.output
    assert named == [] and "nothing to diagnose" in _diagnosis(result)


def test_c_frozen_chain_position_is_named(chained, tmp_path):
    library = build_library(FIXTURES / "candidates" / "mtp_step_v2.c", tmp_path, ("MTP_MUTANT_CHAIN_POS_FROZEN",))
    result, named = _explained(chained[0], f"c:{library}", tmp_path)
    assert result.exit_code == 1 and "attn at depth 2 bridge 0" in last_line(result), result.output
    assert named[:1] == ["position_frozen"], _diagnosis(result)


# --- the selftest's loop mutants (fixtures/candidates/numpy_loop_mutants.py, mtp_step_v2.c -DMTP_MUTANT_<NAME>) ----

# draft_embed_tokens is left out: these driven runs capture no `draft` stage (the report says so), so the mutant has
# nothing to show and passes the float stages, rightly; its diagnosis is tested on dumps that capture the draft
# (tests/probe/test_explain_loop.py).
LANDED = ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept")


@pytest.mark.parametrize("variant", LANDED)
def test_landed_python_loop_mutants_are_named(chained, tmp_path, monkeypatch, variant):
    monkeypatch.syspath_prepend(str(FIXTURES / "candidates"))
    result, named = _explained(chained[0], f"python:numpy_loop_mutants:{variant}", tmp_path)
    assert result.exit_code == 1, result.output
    assert named[:1] == [variant], _diagnosis(result)


@pytest.mark.parametrize("variant", LANDED)
def test_landed_c_loop_mutants_are_named(chained, tmp_path, variant):
    library = build_library(FIXTURES / "candidates" / "mtp_step_v2.c", tmp_path, (f"MTP_MUTANT_{variant.upper()}",))
    result, named = _explained(chained[0], f"c:{library}", tmp_path)
    assert result.exit_code == 1, result.output
    assert named[:1] == [variant], _diagnosis(result)
