"""`mtp-probe diff` on bad or unusual candidates: inputs, layout, coverage, raw directories, unreadable files.

Every problem exits 2 with a message naming it, never a traceback (tracekit.diff_cli checks that).
"""

import json
import shutil

import h5py
from pathlib import Path

import numpy as np
import pytest

from probe.diff import diff_traces
from probe.errors import ProbeError
from oracle.errors import MtpError
from tests.helpers import TINY_REF
from tests.probe.tracekit import copy_stages, diff_cli, last_line, ref_data, write_h5, write_raw  # noqa: F401


def changed_inputs(inputs, **arrays):
    from dataclasses import replace

    return replace(inputs, **arrays)


@pytest.mark.parametrize("name, change, shown", [
    ("token_ids", lambda a: np.where(np.arange(a.size) == 3, a + 1, a), "token 3: reference 255, candidate 256"),
    ("positions", lambda a: a + 1, "token 0: reference 0, candidate 1"),
    ("hidden", lambda a: np.where(np.arange(a.shape[0])[:, None] == 6, np.nextafter(a, np.float32(9)), a), ""),
])
def test_inputs_that_differ_from_the_reference_are_invalid(tmp_path, ref_data, name, change, shown):
    inputs, stages = ref_data
    cand = changed_inputs(inputs, **{name: change(getattr(inputs, name)).astype(getattr(inputs, name).dtype)})
    result = diff_cli(TINY_REF, write_h5(tmp_path / "c.h5", cand, copy_stages(stages)), "--json", tmp_path / "r.json")
    assert result.exit_code == 2 and f"inputs differ: inputs/{name}" in last_line(result)
    assert shown in result.output and f"DIFFER from the reference: {name}" in result.output
    issue = json.loads((tmp_path / "r.json").read_text())["issues"][0]
    assert issue["where"] == f"inputs/{name}"
    assert issue["tokens"] == {"token_ids": [3], "positions": list(range(8)), "hidden": [6]}[name]


def test_identical_recorded_inputs_pass_and_missing_ones_are_a_note(tmp_path, ref_data):
    inputs, stages = ref_data
    recorded = diff_cli(TINY_REF, write_raw(tmp_path / "with", stages, inputs))
    assert recorded.exit_code == 0
    assert "identical to the reference: token_ids, positions, hidden" in recorded.output
    bare = diff_cli(TINY_REF, write_raw(tmp_path / "bare", stages))
    assert bare.exit_code == 0 and "inputs not recorded: not verified" in bare.output


def test_raw_inputs_json_with_other_tokens_is_invalid(tmp_path, ref_data):
    inputs, stages = ref_data
    raw = write_raw(tmp_path / "raw", stages, inputs, hidden=False)
    (raw / "inputs.json").write_text(json.dumps({"token_ids": [1] * 8, "positions": list(range(8))}))
    result = diff_cli(TINY_REF, raw)
    assert result.exit_code == 2 and "inputs differ: inputs/token_ids at token(s) 0-7" in last_line(result)
    assert "not recorded (not verified): hidden" in result.output


def test_raw_dir_equal_to_the_reference_passes(tmp_path, ref_data):
    inputs, stages = ref_data
    result = diff_cli(TINY_REF, write_raw(tmp_path / "raw", stages, inputs))
    assert result.exit_code == 0 and "(raw dir)" in result.output
    assert last_line(result).startswith("PASSED | 11 stages x 8 tokens within tolerance")


def test_raw_dir_with_nine_stages_lists_the_missing_ones_and_never_passes_them(tmp_path, ref_data):
    _, stages = ref_data
    path = write_raw(tmp_path / "raw", copy_stages(stages, ("mh", "mlp")))
    result = diff_cli(TINY_REF, path, "--json", tmp_path / "r.json")
    assert result.exit_code == 0
    assert last_line(result).startswith("PASSED | 9 stages x 8 tokens within tolerance | 9/11 stages, not "
                                        "captured: mh, mlp | ref=")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["stages"]["not_captured"] == ["mh", "mlp"]
    assert not [r for r in report["rows"] if r["stage"] in ("mh", "mlp")]
    table_row = next(line for line in result.output.splitlines() if line.startswith("t3 "))
    assert table_row.split()[8:10] == ["-", "-"]  # columns mh, mlp


def test_raw_dir_without_attn_and_out_is_inconclusive(tmp_path, ref_data):
    _, stages = ref_data
    result = diff_cli(TINY_REF, write_raw(tmp_path / "raw", copy_stages(stages, ("attn", "out"))))
    assert result.exit_code == 3
    assert "INCONCLUSIVE" in last_line(result) and "9/11 stages, not captured: attn, out" in last_line(result)


@pytest.mark.parametrize("kind", ["h5", "raw"])
def test_a_candidate_that_captures_nothing_is_invalid(tmp_path, ref_data, kind):
    inputs, _ = ref_data
    path = write_h5(tmp_path / "c.h5", inputs, {}) if kind == "h5" else write_raw(tmp_path / "raw", {}, inputs)
    result = diff_cli(TINY_REF, path)
    assert result.exit_code == 2 and "no stage captured" in last_line(result)


def test_unknown_raw_stage_file_is_an_error(tmp_path, ref_data):
    _, stages = ref_data
    raw = write_raw(tmp_path / "raw", copy_stages(stages))
    shutil.copy(raw / "fc.bin", raw / "fc_out.bin")
    result = diff_cli(TINY_REF, raw)
    assert result.exit_code == 2 and last_line(result).startswith("INVALID | ")  # once: not repeated as Error:
    assert "unknown stage files fc_out.bin" in result.output and "e, h, fc_in, fc" in result.output


@pytest.mark.parametrize("content", ["{not json", '{"tokens": [1]}', '{"token_ids": [1.5]}', "[1, 2]"])
def test_malformed_inputs_json_is_an_error(tmp_path, ref_data, content):
    _, stages = ref_data
    raw = write_raw(tmp_path / "raw", copy_stages(stages))
    (raw / "inputs.json").write_text(content)
    result = diff_cli(TINY_REF, raw)
    assert result.exit_code == 2 and "inputs.json" in last_line(result) and "token_ids" in last_line(result)


def test_raw_file_of_the_wrong_size_is_invalid(tmp_path, ref_data):
    _, stages = ref_data
    raw = write_raw(tmp_path / "raw", copy_stages(stages))
    stages["fc"][:, :63].astype("<f4").tofile(raw / "fc.bin")  # width 63 instead of 64
    stages["ah"][:7].astype("<f4").tofile(raw / "ah.bin")  # 7 rows instead of 8
    result = diff_cli(TINY_REF, raw, "--json", tmp_path / "r.json")
    assert result.exit_code == 2
    assert "wrong shape: fc at token(s) 0-7, ah at token(s) 0-7" in last_line(result)
    assert "fc.bin (2016 bytes) has shape (504,), expected float32 (8, 64)" in result.output
    assert "ah.bin (1792 bytes) has shape (7, 64)" in result.output
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["status"] for r in rows if r["stage"] in ("fc", "ah")} == {"shape"}


def _rewrite_dataset(path, name, data):
    with h5py.File(path, "r+") as f:
        del f[f"stages/{name}"]
        f.create_dataset(f"stages/{name}", data=data)


def test_hdf5_stage_of_the_wrong_width_is_invalid(tmp_path, ref_data):
    inputs, stages = ref_data
    path = write_h5(tmp_path / "c.h5", inputs, copy_stages(stages))
    _rewrite_dataset(path, "fc_in", stages["fc_in"][:, :64])
    result = diff_cli(TINY_REF, path)
    assert result.exit_code == 2 and "wrong shape: fc_in" in last_line(result)
    assert "has shape (8, 64), expected float32 (8, 128)" in result.output and "stopped after" not in result.output


def test_float64_stage_is_invalid(tmp_path, ref_data):
    inputs, stages = ref_data
    path = write_h5(tmp_path / "c.h5", inputs, copy_stages(stages))
    _rewrite_dataset(path, "mlp", stages["mlp"].astype(np.float64))
    result = diff_cli(TINY_REF, path)
    assert result.exit_code == 2 and "wrong dtype: mlp" in last_line(result) and "is float64" in result.output


def test_big_endian_float32_is_accepted(tmp_path, ref_data):
    inputs, stages = ref_data
    path = write_h5(tmp_path / "c.h5", inputs, copy_stages(stages))
    _rewrite_dataset(path, "mlp", stages["mlp"].astype(">f4"))
    assert diff_cli(TINY_REF, path).exit_code == 0


@pytest.mark.parametrize("which", ["candidate", "reference"])
def test_truncated_hdf5_is_an_error_naming_the_file(tmp_path, which):
    cut = tmp_path / "cut.h5"
    data = TINY_REF.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    args = (TINY_REF, cut) if which == "candidate" else (cut, TINY_REF)
    result = diff_cli(*args)
    assert result.exit_code == 2 and last_line(result).startswith(f"INVALID | {cut} is not a readable HDF5 file")


def test_wrong_schema_version_is_an_error(tmp_path):
    old = tmp_path / "old.h5"
    shutil.copy(TINY_REF, old)
    with h5py.File(old, "r+") as f:
        f.attrs["schema"] = "mtp-trace/0"
    result = diff_cli(TINY_REF, old)
    assert result.exit_code == 2 and "schema mtp-trace/0, this tool reads mtp-trace/1" in last_line(result)


def test_incomplete_reference_is_an_error(tmp_path, ref_data):
    inputs, stages = ref_data
    partial = write_h5(tmp_path / "partial.h5", inputs, copy_stages(stages, ("mh",)))
    result = diff_cli(partial, TINY_REF)
    assert result.exit_code == 2 and "lacks stages mh" in last_line(result) and "mtp-oracle export" in result.output


def test_non_finite_reference_is_an_error(tmp_path, ref_data):
    inputs, stages = ref_data
    bad = copy_stages(stages)
    bad["res2"][4, 0] = np.inf
    result = diff_cli(write_h5(tmp_path / "bad.h5", inputs, bad), TINY_REF)
    assert result.exit_code == 2 and "stage res2 holds NaN/Inf" in last_line(result)


SWEEP = """
import sys
from pathlib import Path
from oracle.errors import MtpError
from probe.diff import diff_traces
ref, step, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
data, errors = ref.read_bytes(), 0
for offset in range(0, len(data), step):
    damaged = bytearray(data)
    damaged[offset:offset + 256] = b"\\xff" * 256
    path = out / f"corrupt_{offset}.h5"
    path.write_bytes(bytes(damaged))
    try:
        diff_traces(ref, path)
    except MtpError:
        errors += 1
    path.unlink()
print(errors)
"""


def test_corrupt_bytes_anywhere_give_a_verdict_or_a_user_error(tmp_path):
    """Overwrite 256 bytes at every 1 KiB of a copy: never a traceback, and never a hang (libhdf5 loops forever on
    some damaged heaps: the trace writer keeps attributes inline, and this sweep runs in a child with a timeout)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SWEEP, str(TINY_REF), "1024", str(tmp_path)], capture_output=True,
                          text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip()) > 0


def test_usage_errors(tmp_path):
    one = diff_cli(TINY_REF, TINY_REF, "--rtol", "1e-3")
    assert one.exit_code == 2 and "--rtol without --atol: give both" in one.output
    assert "API" not in one.output and "Tol(" not in one.output  # no internal names (issue 28)
    unknown = diff_cli(TINY_REF, TINY_REF, "--stage-tol", "fcc=1e-3,1e-4")
    assert unknown.exit_code == 2 and "'fcc' is not a stage of the reference" in last_line(unknown)
    # the reference's own stages are listed, not every family's (issue 28): a dense reference has no router
    assert "its stages: e, h, fc_in, fc, ah, attn, res1, mh, mlp, res2, out." in unknown.output
    assert "router_logits" not in unknown.output
    missing = diff_cli(TINY_REF, tmp_path / "nope.h5")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    unwritable = diff_cli(TINY_REF, TINY_REF, "--json", tmp_path / "no" / "dir" / "r.json")
    assert unwritable.exit_code == 2 and "--json" in last_line(unwritable)


def test_probe_errors_are_mtp_errors():
    assert issubclass(ProbeError, MtpError)


def test_a_stage_tolerance_for_a_stage_the_reference_lacks_is_refused():
    """Red team 2: `--stage-tol router_logits=...` on a dense reference was silently ignored. Twin: a stage it
    has is accepted."""
    result = diff_cli(TINY_REF, TINY_REF, "--stage-tol", "router_logits=1e-3,1e-4")
    assert result.exit_code == 2 and "'router_logits' is not a stage of the reference" in result.output
    assert diff_cli(TINY_REF, TINY_REF, "--stage-tol", "attn=1e-3,1e-4").exit_code == 0
