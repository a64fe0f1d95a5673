"""`mtp-oracle inspect` defines each stage (its one-line doc and shape, from the trace itself) and counts the
stages against the trace's own list, whatever the family."""

import pytest

from oracle.cli import cli
from oracle.trace import read_trace
from tests.helpers import TINY_REF, load_script, run_cli


def _stage_lines(output: str) -> dict[str, str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("stages (in order"))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        body.append(line.split(maxsplit=1))
    return {name: rest for name, rest in body}


def test_every_stage_is_defined_with_its_doc_and_shape():
    result = run_cli(cli, ["inspect", TINY_REF])
    assert result.exit_code == 0, result.output
    shown = _stage_lines(result.output)
    with read_trace(TINY_REF) as ref:
        stages = list(ref.stage_list)
    assert list(shown) == [s.name for s in stages]
    for stage in stages:
        assert stage.doc and shown[stage.name].split(maxsplit=1) == [stage.shape, stage.doc]
    assert result.output.strip().splitlines()[-1].strip() == "11/11 stages"


@pytest.fixture(scope="module")
def moe_trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect_moe")
    ckpt = load_script("make_fixtures").write_moe_checkpoint(root / "ckpt", "qwen3_5_moe", "fused", main_model=False)
    trace = root / "moe.h5"
    result = run_cli(cli, ["export", ckpt, "--out", trace, "--tokens", "5,17,3", "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    return trace


def test_a_moe_trace_is_counted_against_its_own_stage_list(moe_trace):
    result = run_cli(cli, ["inspect", moe_trace])
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1].strip()
    assert last == "16/16 stages"  # not 16/11: the default list is not this trace's
    shown = _stage_lines(result.output)
    assert len(shown) == 16 and shown["topk_ids"].endswith("[compared as a set]")
    with read_trace(moe_trace) as ref:
        assert all(shown[s.name].split(maxsplit=1)[1].startswith(s.doc) for s in ref.stage_list)
