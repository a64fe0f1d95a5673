"""A MoE reference records the routed experts it used and their digest (`experts`); the head digest leaves routed
experts out. `run --checkpoint`, the checkpoint `run` finds by head digest, and `--explain` (run or diff) refuse a
checkpoint whose used experts differ from the reference's (exit 2, naming the checkpoint), instead of blaming a
correct candidate for `routed`. Twins: the reference's own checkpoint still passes, and so does one that differs
only in an expert the trace never used (the digest covers the used experts only)."""

import json
import shutil

import h5py
import pytest

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.trace import read_trace
from probe.cli import cli as probe_cli
from probe.diff import diff_traces
from probe.errors import ProbeError
from probe.run import checkpoint_for, recorded_experts
from probe.tolerance import tol_table
from tests.helpers import FIXTURES, ROOT, TINY_REF, run_cli

CANDIDATES = ROOT / "fixtures" / "candidates"
IMPL = "python:numpy_moe_step:make_head"
MOE = {"per_expert": FIXTURES / "qwen3_5_moe_tiny", "fused": FIXTURES / "qwen3_next_tiny_fused"}


def expert_extents(ckpt_dir, e: int) -> list[tuple]:
    """(file, byte offset, bytes) of every stored part of routed expert `e` (its rows of a fused tensor)."""
    ckpt = Checkpoint(ckpt_dir)
    layout = ckpt.layout().experts
    if layout.kind == "fused":
        entries = [ckpt.entry(name) for name in layout.tensor_names()]
        return [(x.file, x.offset + e * (x.nbytes // x.shape[0]), x.nbytes // x.shape[0]) for x in entries]
    entries = [ckpt.entry(layout.names[p].format(e=e)) for p in ("gate", "up", "down")]
    return [(x.file, x.offset, x.nbytes) for x in entries]


def overwrite_expert(ckpt_dir, target: int, source: int) -> None:
    """Expert `target`'s stored bytes replaced by expert `source`'s, in place: real weights, other values (the
    router, a dense tensor, decides the routing: it is unchanged)."""
    for (src, s_off, n), (dst, d_off, m) in zip(expert_extents(ckpt_dir, source), expert_extents(ckpt_dir, target)):
        assert n == m
        with open(src, "rb") as f:
            f.seek(s_off)
            data = f.read(n)
        with open(dst, "r+b") as f:
            f.seek(d_off)
            f.write(data)


@pytest.fixture(scope="module", params=list(MOE))
def moe(request, tmp_path_factory):
    """(reference, its checkpoint, a copy with a used expert changed, a copy with an unused expert changed)."""
    root = tmp_path_factory.mktemp(f"experts_check_{request.param}")
    orig = shutil.copytree(MOE[request.param], root / "orig")
    ref = root / "ref.h5"
    result = run_cli(oracle_cli, ["export", orig, "--out", ref, "--tokens", "5,17,3,99", "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    experts = recorded_experts(ref)
    used = experts["used"]
    unused = sorted(set(range(Checkpoint(orig).layout().experts.num_experts)) - set(used))
    assert len(unused) >= 2, used  # the test needs experts no token routes to
    changed = shutil.copytree(orig, root / "changed_used")
    overwrite_expert(changed, used[0], unused[0])
    idle = shutil.copytree(orig, root / "changed_unused")
    overwrite_expert(idle, unused[1], unused[0])
    assert Checkpoint(changed).head_digest() == Checkpoint(orig).head_digest()  # only the experts tell them apart
    return ref, orig, changed, idle


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(CANDIDATES))


def _refused(result, ckpt) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a message, no traceback
    assert f"checkpoint {ckpt}: its routed experts differ from those" in result.output
    assert "Pass the reference's checkpoint (--checkpoint DIR)" in result.output
    assert any(line.startswith("INVALID | checkpoint") for line in result.output.splitlines())
    assert "DIVERGED" not in result.output


def _passed(result) -> None:
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("PASSED | 16 stages x 4 tokens"), result.output


def test_run_refuses_a_checkpoint_whose_used_experts_differ(moe, on_path):
    ref, _, changed, _ = moe
    result = run_cli(probe_cli, ["run", ref, "--impl", IMPL, "--checkpoint", changed])
    _refused(result, changed)
    experts = recorded_experts(ref)
    shown = ", ".join(map(str, experts["used"]))
    assert f"the {len(experts['used'])} routed expert(s) the reference used ({shown}) have digest" in result.output
    assert f"{experts['digest']} in the reference" in result.output


def test_twin_run_with_the_references_checkpoint_passes(moe, on_path):
    ref, orig, _, _ = moe
    _passed(run_cli(probe_cli, ["run", ref, "--impl", IMPL, "--checkpoint", orig]))


def test_a_change_to_an_expert_the_trace_never_used_is_accepted(moe, on_path):
    ref, _, _, idle = moe
    _passed(run_cli(probe_cli, ["run", ref, "--impl", IMPL, "--checkpoint", idle]))


def test_run_without_checkpoint_refuses_the_recorded_one_when_its_experts_changed(moe, on_path, tmp_path):
    ref, _, changed, _ = moe
    moved = _recording(shutil.copy(ref, tmp_path / "ref.h5"), str(changed))  # the recorded folder is a directory
    _refused(run_cli(probe_cli, ["run", moved, "--impl", IMPL]), changed)


def test_explain_refuses_a_checkpoint_whose_used_experts_differ(moe, on_path):
    ref, _, changed, _ = moe
    _refused(run_cli(probe_cli, ["run", ref, "--impl", IMPL, "--checkpoint", changed, "--explain"]), changed)
    _refused(run_cli(probe_cli, ["diff", ref, ref, "--explain", "--checkpoint", changed]), changed)


def test_explain_itself_checks_the_experts_given_a_checkpoint_directly(moe):
    """The library call, without checkpoint_for: explain checks the experts where it checks the head digest."""
    from probe.explain import explain_diff

    ref, orig, changed, idle = moe
    tols = tol_table()
    report = diff_traces(ref, ref, tols)
    with pytest.raises(ProbeError, match=r"its routed experts differ from those .* in the reference"):
        explain_diff(report, ref, ref, changed, tols)
    for ckpt in (orig, idle):  # twins: the reference's checkpoint, and one that differs only where no token routes
        assert explain_diff(report, ref, ref, ckpt, tols).not_run == "nothing to diagnose: no row diverges"


def test_twin_explain_with_the_references_checkpoint_runs(moe, on_path):
    ref, orig, _, _ = moe
    result = run_cli(probe_cli, ["run", ref, "--impl", IMPL, "--checkpoint", orig, "--explain"])
    _passed(result)
    assert "routed by these tokens" in result.output


# ---- a moved checkpoint found by its head digest ------------------------------------------------------------------

def _recording(ref, checkpoint: str):
    """`ref` with its provenance's checkpoint path replaced (a trace exported elsewhere, or a moved checkpoint)."""
    with h5py.File(ref, "r+") as f:
        provenance = json.loads(f.attrs["provenance"])
        f.attrs["provenance"] = json.dumps(provenance | {"checkpoint": checkpoint}, sort_keys=True)
    return ref


def test_a_folder_with_the_same_head_but_other_used_experts_is_not_picked(moe, tmp_path, monkeypatch):
    ref, _, changed, _ = moe
    moved = _recording(shutil.copy(ref, tmp_path / "ref.h5"), "/nowhere/moved/ckpt")
    shutil.copytree(changed, tmp_path / "a_decoy")  # same config and head digest; looked at first
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProbeError, match=r"a_decoy holds the same head weights .* but its routed experts differ "
                                         r"from those the reference was exported from .* Pass --checkpoint DIR"):
        checkpoint_for(moved, None)
    result = run_cli(probe_cli, ["run", moved, "--impl", IMPL])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit) and "a_decoy" in result.output


def test_twin_the_folder_with_the_same_used_experts_is_picked_past_the_decoy(moe, tmp_path, monkeypatch, on_path):
    ref, orig, changed, idle = moe
    moved = _recording(shutil.copy(ref, tmp_path / "ref.h5"), "/nowhere/moved/ckpt")
    shutil.copytree(changed, tmp_path / "a_decoy")
    shutil.copytree(orig, tmp_path / "weights")
    monkeypatch.chdir(tmp_path)
    notes = []
    assert checkpoint_for(moved, None, log=notes.append) == tmp_path / "weights"
    assert "the same routed experts" in notes[0]
    _passed(run_cli(probe_cli, ["run", moved, "--impl", IMPL]))
    shutil.rmtree(tmp_path / "weights")
    shutil.copytree(idle, tmp_path / "weights")  # differs only in an expert the trace never used: the same experts
    assert checkpoint_for(moved, None) == tmp_path / "weights"


# ---- bad input, and references without experts ----------------------------------------------------------------------

@pytest.mark.parametrize("experts, message", [
    ({"layout": "per_expert", "used": "all", "digest": "xxh3-128/typed:00"}, "has 'used' 'all', not a list"),
    ({"layout": "per_expert", "used": [1, -2], "digest": "xxh3-128/typed:00"}, "has 'used' [1, -2], not a list"),
    ({"layout": "per_expert", "used": [1], "digest": "md5:00"}, "has 'digest' 'md5:00', not a digest of a known"),
    ({"layout": "per_expert", "used": [1], "digest": None}, "has 'digest' None"),
    ({"layout": "per_expert", "used": [999], "digest": "xxh3-128/typed:00"}, "but its own topk_ids select"),
])
def test_a_malformed_experts_attribute_exits_2_with_a_message(moe, tmp_path, on_path, experts, message):
    ref, orig, _, _ = moe
    bad = shutil.copy(ref, tmp_path / "ref.h5")
    with h5py.File(bad, "r+") as f:
        f.attrs["experts"] = json.dumps(experts)
    result = run_cli(probe_cli, ["run", bad, "--impl", IMPL, "--checkpoint", orig])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in result.output


def test_twin_a_reference_without_experts_is_not_checked_for_them(monkeypatch):
    assert recorded_experts(TINY_REF) is None  # dense: the head digest covers the whole head
    monkeypatch.chdir(ROOT)
    with read_trace(TINY_REF) as ref:
        assert "experts" not in ref.attrs
    assert run_cli(probe_cli, ["run", TINY_REF, "--impl", "torch"]).exit_code == 0


def test_a_reference_with_an_older_digest_scheme_is_checked_in_its_own_scheme(moe, tmp_path, on_path):
    """Traces written before the typed scheme record `xxh3-128:` (bytes only): recomputed in that scheme."""
    from oracle.experts_digest import BYTES_ONLY, scheme_of

    ref, orig, changed, _ = moe
    old = shutil.copy(ref, tmp_path / "old.h5")
    with h5py.File(old, "r+") as f:
        experts = json.loads(f.attrs["experts"])
        experts["digest"] = Checkpoint(orig).experts_digest(experts["used"], scheme=BYTES_ONLY)
        f.attrs["experts"] = json.dumps(experts)
    assert scheme_of(experts["digest"]) == BYTES_ONLY
    _passed(run_cli(probe_cli, ["run", old, "--impl", IMPL, "--checkpoint", orig]))
    _refused(run_cli(probe_cli, ["run", old, "--impl", IMPL, "--checkpoint", changed]), changed)


def test_a_used_list_that_leaves_out_a_changed_expert_is_refused(moe, tmp_path, on_path):
    """`used` edited to drop the changed expert, its digest recomputed over the rest from the changed checkpoint:
    the experts check alone would then pass that checkpoint, so `used` must be what the reference's own topk_ids
    select (a careless edit, or a trace spliced from another export)."""
    ref, orig, changed, _ = moe
    experts = recorded_experts(ref)
    kept = experts["used"][1:]  # the fixture changed used[0]
    spliced = shutil.copy(ref, tmp_path / "spliced.h5")
    with h5py.File(spliced, "r+") as f:
        f.attrs["experts"] = json.dumps(experts | {"used": kept,
                                                   "digest": Checkpoint(changed).experts_digest(kept)})
    result = run_cli(probe_cli, ["run", spliced, "--impl", IMPL, "--checkpoint", changed])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "but its own topk_ids select" in result.output
