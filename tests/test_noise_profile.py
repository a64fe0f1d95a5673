"""Measured tolerance profiles: `mtp-oracle noise` measures each stage's rounding noise against a float64 run of the
head, and `mtp-probe diff/run --profile FILE[:PATH]` uses those per-stage figures instead of the fixed bf16 profile."""

import dataclasses
import json

import pytest

from oracle.cli import cli as oracle_cli
from oracle.trace import read_trace
from probe.cli import cli as probe_cli
from tests.helpers import FIXTURES, TINY, TINY_REF, load_script, run_cli

MOE = FIXTURES / "qwen3_5_moe_tiny"
FIX = load_script("make_fixtures")
TOKENS = ",".join(map(str, FIX.REF_TOKENS))  # the stored reference's inputs (T=8, H from seed 0)
MOE_TOKENS = "17,42,3,255,100,7"


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


def noise(tmp_path, checkpoint, tokens, *extra):
    out = tmp_path / f"{checkpoint.name}_noise.json"
    result = run_cli(oracle_cli, ["noise", checkpoint, "--tokens", tokens, "--hidden-seed", FIX.REF_HIDDEN_SEED,
                                  "--out", out, "-q", *extra])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return noise(tmp_path_factory.mktemp("noise"), TINY, TOKENS)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The MoE fixture's profile and a reference exported from the same inputs."""
    tmp = tmp_path_factory.mktemp("noise_moe")
    ref = tmp / "moe_ref.h5"
    exported = run_cli(oracle_cli, ["export", MOE, "--out", ref, "--tokens", MOE_TOKENS, "--hidden-seed",
                                    FIX.REF_HIDDEN_SEED, "-q"])
    assert exported.exit_code == 0, exported.output
    return noise(tmp, MOE, MOE_TOKENS), ref


def figures(profile_path, path: str) -> dict:
    return json.loads(profile_path.read_text())["paths"][path]["stages"]


def test_bf16_noise_exceeds_float32_noise_which_is_tiny(dense, moe):
    for profile in (dense, moe[0]):
        f32, bf16, fp16 = (figures(profile, p) for p in ("float32", "bfloat16", "float16"))
        rows = [name for name, f in f32.items() if f["kind"] == "rows"]
        for name in rows:
            assert f32[name]["measured_max_rel"] < 1e-5 < fp16[name]["measured_max_rel"] \
                   < bf16[name]["measured_max_rel"] < 5e-2, name
        # e, h and fc_in are norms that transformers computes in float32 in the truth too: 0 there, hence the floor
        assert all(f32[name]["measured_max_rel"] > 0 for name in rows[rows.index("fc"):])
        assert {f["kind"] for f in bf16.values()} == {"rows", "index_set"}  # dense too: the draft is an index set
        assert bf16["draft"] == {"kind": "index_set", "flipped_tokens": bf16["draft"]["flipped_tokens"]}


def test_profile_records_rule_margin_and_the_references_identity(dense, tmp_path):
    profile = json.loads(dense.read_text())
    with read_trace(TINY_REF) as ref:
        assert profile["checkpoint_digest"] == ref.attrs["checkpoint_digest"]
        assert profile["inputs"]["inputs_digest"] == ref.attrs["inputs_digest"]
        assert profile["stages"] == [*ref.stages, "draft"]  # the stored reference predates the draft stage
    assert (profile["schema"], profile["family"], profile["margin"]) == ("mtp-noise-profile/1", "qwen3_5", 4.0)
    for path in ("float32", "bfloat16", "float16"):
        u = profile["paths"][path]["unit_roundoff"]
        for f in (f for f in profile["paths"][path]["stages"].values() if f["kind"] == "rows"):  # not the draft
            assert f["rtol"] == pytest.approx(4 * max(f["measured_max_rel"], u))
            assert f["atol"] == pytest.approx(f["rtol"] * f["min_row_scale"])
    doubled = noise(tmp_path, TINY, TOKENS, "--margin", "8", "--paths", "bfloat16")
    again = json.loads(doubled.read_text())
    assert list(again["paths"]) == ["bfloat16"] and again["margin"] == 8
    assert again["paths"]["bfloat16"]["stages"]["mlp"]["rtol"] == pytest.approx(
        2 * profile["paths"]["bfloat16"]["stages"]["mlp"]["rtol"])


def test_profile_passes_an_honest_bf16_candidate_and_states_its_noise_floor(dense, tmp_path):
    report = tmp_path / "r.json"
    result = run_cli(probe_cli, ["run", TINY_REF, "--impl", "torch:cpu:bfloat16", "--profile", dense, "--json",
                                 report, "--out", tmp_path / "bf16.h5", "-q"])
    assert result.exit_code == 0 and last_line(result).startswith("PASSED"), result.output
    assert f"noise      {dense} path bfloat16, tolerance = 4 x measured (qwen3_5, T=8, the reference's own " \
           f"inputs)" in result.output
    noise_json = json.loads(report.read_text())["noise_profile"]
    assert (noise_json["path"], noise_json["margin"], noise_json["same_inputs"]) == ("bfloat16", 4.0, True)
    assert noise_json["stages"]["mlp"] == figures(dense, "bfloat16")["mlp"]
    trace = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "bf16.h5", "--profile", f"{dense}:bfloat16", "-q"])
    assert trace.exit_code == 0 and last_line(trace).startswith("PASSED"), trace.output
    # the twin: the float32 path's floor is far below bf16 rounding
    strict = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "bf16.h5", "--profile", f"{dense}:float32", "-q"])
    assert strict.exit_code == 1 and last_line(strict).startswith("DIVERGED | first divergent stage: e at token 0")


def test_profile_catches_a_rope_error_the_fixed_bf16_profile_passes(dense, tmp_path):
    """A bf16 candidate with the RoPE base off (3e4 for the config's 1e7): every stage within 5% (the fixed bfloat16
    profile's rtol), but attn ~4% off, above its measured bf16 noise x 4."""
    from probe.adapters.torch_ref import TorchAdapter
    from probe.run import run_and_diff
    from probe.tolerance import tol_table

    adapter = TorchAdapter(TINY, "cpu", "bfloat16")
    adapter.cfg = dataclasses.replace(adapter.cfg, rope_theta=3e4)
    run_and_diff(TINY_REF, adapter, tol_table(), out=tmp_path / "rope.h5")
    fixed = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "rope.h5", "--profile", "bfloat16", "-q"])
    assert fixed.exit_code == 0 and last_line(fixed).startswith("PASSED"), fixed.output
    measured = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "rope.h5", "--profile", dense, "-q",
                                   "--json", tmp_path / "r.json"])
    assert measured.exit_code == 1, measured.output
    assert last_line(measured).startswith("DIVERGED | first divergent stage: attn")
    attn = [r for r in json.loads((tmp_path / "r.json").read_text())["rows"] if r["stage"] == "attn"]
    worst = max(r["max_rel"] for r in attn)
    assert figures(dense, "bfloat16")["attn"]["rtol"] < worst < 5e-2
    # --stage-tol still overrides one stage of the measured profile
    loosened = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "rope.h5", "--profile", dense, "-q",
                                   "--stage-tol", "attn=5e-2,1e-3"])
    assert "--stage-tol attn=5e-2,1e-3" in loosened.output and "first divergent stage: attn" not in loosened.output


def test_moe_profile_covers_routing_stages(moe):
    profile, ref = moe
    result = run_cli(probe_cli, ["diff", ref, ref, "--profile", profile, "-q"])
    assert result.exit_code == 0 and last_line(result).startswith("PASSED"), result.output
    assert "topk_ids      compared as a set" in result.output
    assert json.loads(profile.read_text())["paths"]["bfloat16"]["routing_flips"] == []


def _edited(tmp_path, source, edit, resign: bool = True, name: str = "edited.json") -> str:
    """`source` edited by `edit`; `resign`: its profile_digest recomputed, as a forger would, so that the checks
    behind the digest are exercised too."""
    from oracle.noise import DIGEST_KEY, profile_digest

    profile = json.loads(source.read_text())
    edit(profile)
    if resign and DIGEST_KEY in profile:
        profile[DIGEST_KEY] = profile_digest(profile)
    out = tmp_path / name
    out.write_text(json.dumps(profile))
    return str(out)


def _loosened(p):
    """The red team's edit: margin 4 -> 40 with every stage's rtol and atol recomputed by the profile's own rule."""
    p["margin"] = 40.0
    for path in p["paths"].values():
        for entry in path["stages"].values():
            if isinstance(entry, dict) and entry.get("rtol") is not None:
                entry["rtol"] *= 10
                entry["atol"] *= 10


def test_an_edited_profile_is_refused_by_its_digest(tmp_path, dense):
    """Red team: a profile edited consistently (margin 4 -> 40, tolerances recomputed) passed a candidate 30% off at
    attn. It no longer matches its profile_digest; neither does one whose digest was removed. Twin: the profile as
    written is accepted."""
    from oracle.noise import DIGEST_KEY

    loosened = _edited(tmp_path, dense, _loosened, resign=False)
    unsigned = _edited(tmp_path, dense, lambda p: p.pop(DIGEST_KEY), name="unsigned.json")
    for edited, words in ((loosened, "do not match its profile_digest"), (unsigned, "has no profile_digest")):
        result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", edited, "-q"])
        assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output
    assert run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", str(dense), "-q"]).exit_code == 0


def _drop_mlp(p):
    del p["paths"]["bfloat16"]["stages"]["mlp"]


def _overflow(p):
    p["paths"]["bfloat16"]["stages"]["res2"].update(nonfinite_rows=3, rtol=None)


def _other_head(p):
    p["checkpoint_digest"] = "sha256:" + "0" * 64


@pytest.mark.parametrize("spec, message", [
    (lambda tmp, dense, moe: str(tmp / "missing.json"), "neither a named profile (bfloat16, float32) nor an existing"),
    (lambda tmp, dense, moe: _write(tmp / "junk.json", "{not json"), "cannot read it as a noise profile"),
    (lambda tmp, dense, moe: _write(tmp / "old.json", '{"schema": "mtp-noise-profile/0"}'),
     "schema 'mtp-noise-profile/0', this probe reads mtp-noise-profile/1"),
    (lambda tmp, dense, moe: str(moe[0]), "was measured on a qwen3_5_moe head; the reference"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _other_head), "was exported from another head"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _drop_mlp), "the reference's stages mlp are not in the profile"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _overflow), "computed NaN/Inf at res2"),
    (lambda tmp, dense, moe: f"{dense}:int8", "the profile measured float32, bfloat16, float16"),
    # red team: edited tolerances were trusted (rtol 0.5 passed a candidate 30% off at attn)
    (lambda tmp, dense, moe: _edited(tmp, dense, _set("attn", rtol=0.5)), "a stage states rtol 0.5"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _set("attn", atol=1.0)), "atol at most"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _set("attn", rtol=True)), "rtol is True: expected a number"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _set("attn", measured_max_rel="0.01")), "measured_max_rel is '0.01'"),
    (lambda tmp, dense, moe: _edited(tmp, dense, lambda p: p.update(margin=-4)), "margin is -4"),
    (lambda tmp, dense, moe: _edited(tmp, dense, lambda p: p["inputs"].update(num_tokens="abc")),
     "inputs.num_tokens is 'abc'"),
    (lambda tmp, dense, moe: _edited(tmp, dense, lambda p: p.pop("checkpoint_digest")), "does not say which head"),
    (lambda tmp, dense, moe: _edited(tmp, dense, _coarse("attn")), "which checks nothing"),
    (lambda tmp, dense, moe: _edited(tmp, dense, lambda p: p.pop("family")), "does not say which family"),
], ids=["missing", "unreadable", "schema", "family", "checkpoint", "stages", "overflow", "path", "rtol-edited",
        "atol-edited", "rtol-bool", "figure-string", "margin-negative", "num-tokens", "no-digest", "coarse", "no-family"])
def test_bad_profiles_are_refused(tmp_path, dense, moe, spec, message):
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", spec(tmp_path, dense, moe), "-q"])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def _set(stage, **fields):
    return lambda p: p["paths"]["bfloat16"]["stages"][stage].update(fields)


def _coarse(stage):
    """A self-consistent stage whose measured noise is 30% (margin 4: rtol 1.2): a path that checks nothing there."""
    def edit(p):
        entry = p["paths"]["bfloat16"]["stages"][stage]
        entry.update(measured_max_rel=0.3, rtol=1.2, atol=1.2 * entry["min_row_scale"])
    return edit


def test_a_report_may_not_overwrite_the_profile(dense, tmp_path):
    """Red team: --json onto the --profile file replaced the profile with the report."""
    import shutil

    victim = tmp_path / "victim.json"
    shutil.copy(dense, victim)
    before = victim.read_bytes()
    for option in ("--json", "--html"):
        result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", victim, option, victim, "-q"])
        assert result.exit_code == 2 and "is the --profile" in result.output, result.output
    assert victim.read_bytes() == before
    ok = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", victim, "--json", tmp_path / "r.json", "-q"])
    assert ok.exit_code == 0  # twin: another output path


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_profile_with_rtol_atol_is_refused(dense):
    result = run_cli(probe_cli, ["diff", TINY_REF, TINY_REF, "--profile", dense, "--rtol", "1e-2", "--atol", "1e-3"])
    assert result.exit_code == 2 and "would replace all of them" in " ".join(result.output.split())


@pytest.mark.parametrize("args, message", [
    (["--margin", "0.5"], "--margin 0.5: the margin multiplies the measured noise"),
    (["--paths", "bfloat16,int8"], "--paths bfloat16,int8: give one or more of float32, bfloat16, float16"),
    (["--tokens", "17,9999"], "9999"),
])
def test_noise_refuses_bad_options_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "p.json"
    base = ["noise", TINY, "--hidden-seed", "0", "--out", out, "-q"]
    result = run_cli(oracle_cli, base + (args if "--tokens" in args else ["--tokens", TOKENS, *args]))
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not out.exists() and not list(tmp_path.iterdir())


def test_noise_measures_topk_weights_in_the_truths_id_order():
    """Red team: a bf16 rank swap of two near-equal experts counted as a huge topk_weights error (rtol 0.6-1.2 on
    DeepSeek heads: a stage that checked nothing), while the probe compares weights by expert id. The same
    selection listed in another order now measures as no error; a real weight error still does (twin)."""
    import numpy as np

    from oracle.noise import _path_figures
    from oracle.stages import INDEX_SET, ROWS, Stage

    ids = np.array([[3, 1], [0, 2]])
    weights = np.array([[0.6, 0.4], [0.7, 0.3]], dtype=np.float32)
    truth = {"topk_ids": ids, "topk_weights": weights}
    swapped = {"topk_ids": ids[:, ::-1].copy(), "topk_weights": weights[:, ::-1].copy()}

    stages = [Stage("topk_ids", "Txk", "ids", INDEX_SET), Stage("topk_weights", "Txk", "weights", ROWS)]
    same = _path_figures(truth, swapped, stages, "bfloat16", 4.0)["stages"]["topk_weights"]
    assert same["measured_max_rel"] == 0.0 and same["rtol"] < 0.05
    wrong = {"topk_ids": ids, "topk_weights": weights * np.float32(0.7)}
    assert _path_figures(truth, wrong, stages, "bfloat16", 4.0)["stages"]["topk_weights"]["measured_max_rel"] > 0.2
