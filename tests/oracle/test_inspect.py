"""`mtp-oracle inspect` defines each stage (its one-line doc and shape, from the trace itself) and counts the
stages against the trace's own list, whatever the family; a MoE trace shows the routed experts it used."""

import json
import shutil

import h5py
import pytest

from oracle.cli import cli
from oracle.inspect import _experts
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
    assert last == "17/17 stages"  # not 17/11: the default list is not this trace's
    shown = _stage_lines(result.output)
    assert len(shown) == 17 and shown["topk_ids"].endswith("[compared as a set]")
    with read_trace(moe_trace) as ref:
        assert all(shown[s.name].split(maxsplit=1)[1].startswith(s.doc) for s in ref.stage_list)


def _experts_line(output: str) -> str | None:
    return next((line for line in output.splitlines() if line.startswith("  experts ")), None)


def test_a_moe_trace_shows_the_routed_experts_it_used(moe_trace):
    result = run_cli(cli, ["inspect", moe_trace])
    assert result.exit_code == 0, result.output
    with read_trace(moe_trace) as ref:
        experts, num_experts = ref.attrs["experts"], ref.dims.num_experts
    used = experts["used"]
    assert num_experts == 8 and 0 < len(used) <= 8
    assert _experts_line(result.output) == (
        f"  experts            layout fused, {len(used)} of {num_experts} used ({','.join(map(str, used))}), "
        f"digest {experts['digest']}")


def test_group_limited_tokens_and_many_used_experts_are_shown(moe_trace, tmp_path):
    trace = shutil.copy(moe_trace, tmp_path / "edited.h5")
    with h5py.File(trace, "r+") as f:  # as a group-limited router's export writes it (DeepSeek-V3, GLM-4.5)
        experts = json.loads(f.attrs["experts"])
        f.attrs["experts"] = json.dumps(experts | {"used": list(range(8)), "group_limited_tokens": 2})
    line = _experts_line(run_cli(cli, ["inspect", trace]).output)
    assert line.endswith(f"8 of 8 used (0,1,2,3,4,5,6,7), digest {experts['digest']}, group_limited_tokens 2")
    assert _experts({"layout": "per_expert", "used": list(range(3, 40)), "digest": "d"}, 64) == \
        "layout per_expert, 37 of 64 used (3,4,5,6,7,8,9,10,…), digest d"
    assert _experts({"used": "all"}, 8) == '{"used": "all"}'  # not in the export's form: shown as stored


def test_twin_a_dense_trace_has_no_experts_line():
    result = run_cli(cli, ["inspect", TINY_REF])
    assert result.exit_code == 0 and _experts_line(result.output) is None
    assert "experts" not in result.output.split("  stages (in order")[0]
