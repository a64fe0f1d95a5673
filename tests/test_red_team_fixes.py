"""Red-team findings, each refused through the real CLIs (exit 2, no traceback, a message naming the bad thing, no
leftover file, inputs unchanged), each with a twin: the honest variant of the same input still works."""

import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import oracle.cli
import probe.cli
from tests.helpers import TINY, TINY_REF, run_cli
from tests.probe.tracekit import load_trace, write_raw
from tests.test_bad_inputs import assert_refused


def _doubled(f, name):
    f[name][...] = f[name][()] * 2.0


# --- 1. HDF5 links and virtual datasets: every dataset the readers use lives in the file itself --------------

def _wrong_target(tmp_path, names=("stages/attn", "inputs/hidden", "evidence/attn_uniform")) -> Path:
    """A copy of the reference whose attention rows (and everything else a link may point at) are wrong."""
    target = Path(shutil.copy(TINY_REF, tmp_path / "target.h5"))
    with h5py.File(target, "r+") as f:
        for name in names:
            _doubled(f, name)
    return target


def _external(name):
    def edit(f, target):
        del f[name]
        f[name] = h5py.ExternalLink(str(target), "/" + name)
    return edit


def _soft(name, to):
    def edit(f, target):
        del f[name]
        f[name] = h5py.SoftLink("/" + to)
    return edit


def _virtual(name):
    def edit(f, target):
        with h5py.File(target, "r") as t:
            source = h5py.VirtualSource(t[name])
            shape, dtype = t[name].shape, t[name].dtype
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[...] = source
        del f[name]
        f.create_virtual_dataset(name, layout)
    return edit


def _external_storage(name):
    def edit(f, target):
        values = f[name][()]
        raw = target.with_suffix(".raw")
        values.astype(values.dtype.newbyteorder("<")).tofile(raw)
        del f[name]
        f.create_dataset(name, shape=values.shape, dtype="<f4", external=[(str(raw), 0, values.nbytes)])
    return edit


def _external_group(name):
    def edit(f, target):
        del f[name]
        f[name] = h5py.ExternalLink(str(target), "/" + name)
    return edit


LINK_CASES = {
    "external link stage": (_external("stages/attn"), r"/stages/attn is an external link"),
    "external link group": (_external_group("stages"), r"/stages is an external link"),
    "external link input": (_external("inputs/hidden"), r"/inputs/hidden is an external link"),
    "external link evidence": (_external("evidence/attn_uniform"), r"/evidence/attn_uniform is an external link"),
    "soft link stage": (_soft("stages/attn", "stages/res1"), r"/stages/attn is a soft link"),
    "virtual stage": (_virtual("stages/attn"), r"/stages/attn is a virtual dataset"),
    "external storage stage": (_external_storage("stages/attn"), r"/stages/attn is stored in external raw files"),
}


def _linked_copy(tmp_path, edit) -> Path:
    target = _wrong_target(tmp_path)
    path = Path(shutil.copy(TINY_REF, tmp_path / "linked.h5"))
    with h5py.File(path, "r+") as f:
        edit(f, target)
    return path


@pytest.mark.parametrize("case", sorted(LINK_CASES))
def test_linked_candidate_is_refused(tmp_path, case):
    edit, pattern = LINK_CASES[case]
    cand = _linked_copy(tmp_path, edit)
    assert_refused(probe.cli.cli, ["diff", TINY_REF, cand], pattern, [TINY_REF, cand], tmp_path)


@pytest.mark.parametrize("case", ["external link stage", "virtual stage"])
def test_linked_reference_is_refused(tmp_path, case):
    edit, pattern = LINK_CASES[case]
    ref = _linked_copy(tmp_path, edit)
    assert_refused(probe.cli.cli, ["diff", ref, TINY_REF], pattern, [TINY_REF, ref], tmp_path)
    assert_refused(oracle.cli.cli, ["inspect", ref], pattern, [ref], tmp_path)


def test_twin_values_copied_in_pass_and_the_link_target_diverges(tmp_path):
    """The same values, copied in (a hard link), pass; the file the link pointed to diverges on its own."""
    cand = Path(shutil.copy(TINY_REF, tmp_path / "copied.h5"))
    with h5py.File(cand, "r+") as f:
        values = f["stages/attn"][()]
        del f["stages/attn"]
        f["stages/attn"] = values
    assert run_cli(probe.cli.cli, ["diff", TINY_REF, cand]).exit_code == 0
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, _wrong_target(tmp_path, ["stages/attn"])])
    assert result.exit_code == 1 and "DIVERGED" in result.output, result.output


# --- 2. raw dump entries that are not regular files ----------------------------------------------------------

def _raw_dump(tmp_path) -> Path:
    inputs, stages = load_trace(TINY_REF)
    return write_raw(tmp_path / "dump", {k: v for k, v in stages.items() if k != "mlp"}, inputs)


RAW_ODD = {
    "dangling symlink": (lambda p: os.symlink(p.parent / "nowhere.bin", p), r"mlp\.bin cannot be read"),
    "directory": (lambda p: os.mkdir(p), r"mlp\.bin is a directory"),
    "fifo": (lambda p: os.mkfifo(p), r"mlp\.bin is a FIFO"),
    "symlink to /dev/zero": (lambda p: os.symlink("/dev/zero", p), r"mlp\.bin is a character device"),
}


@pytest.mark.parametrize("case", sorted(RAW_ODD))
def test_raw_stage_that_is_not_a_regular_file_is_refused(tmp_path, case):
    make, pattern = RAW_ODD[case]
    dump = _raw_dump(tmp_path)
    make(dump / "mlp.bin")
    before = [p for p in dump.iterdir() if p.name != "mlp.bin"]
    assert_refused(probe.cli.cli, ["diff", TINY_REF, dump], pattern, [TINY_REF, *before], tmp_path)


def test_raw_hidden_bin_fifo_is_refused(tmp_path):
    dump = _raw_dump(tmp_path)
    (dump / "hidden.bin").unlink()
    os.mkfifo(dump / "hidden.bin")
    assert_refused(probe.cli.cli, ["diff", TINY_REF, dump], r"hidden\.bin is a FIFO", [TINY_REF], tmp_path)


def test_twin_raw_stage_as_symlink_to_a_regular_file_is_followed(tmp_path):
    """A symlink to a regular file is read; with mlp absent the candidate is not all captured but never refused."""
    inputs, stages = load_trace(TINY_REF)
    dump = _raw_dump(tmp_path)
    stages["mlp"].astype("<f4").tofile(tmp_path / "mlp_elsewhere.bin")
    os.symlink(tmp_path / "mlp_elsewhere.bin", dump / "mlp.bin")
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, dump])
    assert result.exit_code == 0 and "PASSED" in result.output, result.output
    (dump / "mlp.bin").unlink()
    (tmp_path / "wrong.bin").write_bytes((stages["mlp"] * 2).astype("<f4").tobytes())
    os.symlink(tmp_path / "wrong.bin", dump / "mlp.bin")
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, dump])
    assert result.exit_code == 1 and "mlp" in result.output, result.output


# --- 3. a reference holding NaN/Inf is never written --------------------------------------------------------

def _edit_tensors(ckpt: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    for file in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(file)
        if edit(tensors):
            save_file(tensors, file, metadata={"format": "pt"})
            return ckpt
    raise AssertionError("no tensor edited")


def _nan_at(name_end):
    def edit(tensors):
        names = sorted(n for n in tensors if n.endswith(name_end))
        if names:
            tensors[names[0]].view(-1)[0] = float("nan")
        return bool(names)
    return edit


def _fp8_checkpoint(tmp_path) -> Path:
    from tests.helpers import load_script

    return load_script("make_fixtures").write_mtp_layer_checkpoint(tmp_path / "fp8", fp8_block=[16, 32])


NAN_CASES = {
    "bf16 weight": (lambda tmp: shutil.copytree(TINY, tmp / "ckpt"), "mtp.fc.weight",
                    r"stage fc is NaN/Inf at token 0.*NaN/Inf in mtp\.fc\.weight \(BF16\)"),
    "fp8 block scale": (_fp8_checkpoint, "down_proj.weight_scale_inv",
                        r"block scale \S*down_proj\.weight_scale_inv holds NaN/Inf"),  # refused on reading
}


def _scales_set(name_end, value):
    def edit(tensors):
        names = sorted(n for n in tensors if n.endswith(name_end))
        if names:
            tensors[names[0]][...] = value if value == 0 else -tensors[names[0]].abs()
        return bool(names)
    return edit


@pytest.mark.parametrize("value, words", [(0, "is 0 in every block"), (-1, "holds a negative scale")])
def test_block_scales_that_are_no_magnitudes_are_refused(tmp_path, value, words):
    """Red team 2: all-zero FP8 block scales exported an all-zero weight with only a misleading q/k warning;
    negative ones were taken silently. Twin: the untouched FP8 checkpoint exports."""
    args = ["--tokens", "17,42,3", "--hidden-seed", "0", "-q"]
    good = _fp8_checkpoint(tmp_path)
    assert run_cli(oracle.cli.cli, ["export", good, "--out", tmp_path / "ok.h5", *args]).exit_code == 0
    ckpt = _edit_tensors(good, _scales_set("down_proj.weight_scale_inv", value))
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, ["export", ckpt, "--out", out, *args],
                   rf"block scale \S*down_proj\.weight_scale_inv {words}", [ckpt], tmp_path)


def _nan_embedding_row(token):
    def edit(tensors):
        name = "model.language_model.embed_tokens.weight"
        tensors[name][token, 3] = float("inf")
        return True
    return edit


def test_export_with_a_nonfinite_embedding_row_names_the_token_id(tmp_path):
    ckpt = _edit_tensors(Path(shutil.copytree(TINY, tmp_path / "ckpt")), _nan_embedding_row(42))
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, ["export", ckpt, "--out", out, "--tokens", "17,42,3", "--hidden-seed", "0", "-q"],
                   r"stage \w+ is NaN/Inf at token 1 .*embedding rows of token id\(s\) 42 hold NaN/Inf", [ckpt],
                   tmp_path)
    result = run_cli(oracle.cli.cli, ["export", ckpt, "--out", out, "--tokens", "17,3", "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output  # twin: tokens that do not read the damaged row export


@pytest.mark.parametrize("case", sorted(NAN_CASES))
def test_export_of_a_checkpoint_holding_nan_is_refused(tmp_path, case):
    make, tensor, pattern = NAN_CASES[case]
    ckpt = _edit_tensors(Path(make(tmp_path)), _nan_at(tensor))
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, ["export", ckpt, "--out", out, "--tokens", "17,42,3", "--hidden-seed", "0", "-q"],
                   pattern, [ckpt], tmp_path)
    assert not out.exists()


@pytest.mark.parametrize("case", sorted(NAN_CASES))
def test_twin_the_finite_checkpoint_exports(tmp_path, case):
    ckpt = Path(NAN_CASES[case][0](tmp_path))
    out = tmp_path / "ref.h5"
    result = run_cli(oracle.cli.cli, ["export", ckpt, "--out", out, "--tokens", "17,42,3", "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0 and out.exists(), result.output


# --- 4. option parsing: nothing silently dropped or reinterpreted -------------------------------------------

@pytest.mark.parametrize("tokens, pattern", [
    ("17,,42", r"item 2 \(of 3\) is empty"),
    ("17,42,", r"item 3 \(of 3\) is empty"),
    (",17", r"item 1 \(of 2\) is empty"),
    ("\uff11\uff17,42", r"'\uff11\uff17' is not an integer token id \(ASCII digits 0-9 only\)"),
])
def test_export_tokens_with_an_empty_or_non_ascii_item_are_refused(tmp_path, tokens, pattern):
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, ["export", TINY, "--out", out, "--tokens", tokens, "--hidden-seed", "0", "-q"],
                   pattern, [TINY], tmp_path)
    assert not out.exists()


def test_twin_tokens_with_spaces_around_commas_and_a_file_across_lines_export(tmp_path):
    from oracle.inputs import token_ids_from_text

    assert token_ids_from_text(" 17 , 42,3\n255 ", "--tokens").tolist() == [17, 42, 3, 255]
    result = run_cli(oracle.cli.cli, ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", "17, 42", "-q",
                                      "--hidden-seed", "0"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["export", "noise"])
def test_first_token_without_main_model_is_refused(tmp_path, command):
    out = tmp_path / ("ref.h5" if command == "export" else "noise.json")
    assert_refused(oracle.cli.cli, [command, TINY, "--out", out, "--tokens", "17,42", "--hidden-seed", "0",
                                    "--first-token", "9", "-q"],
                   r"--first-token 9 applies only with --main-model.*--hidden-seed", [TINY], tmp_path)
    assert not out.exists()


def test_twin_first_token_with_main_model_exports(tmp_path):
    from tests.helpers import FIXTURES

    out = tmp_path / "ref.h5"
    result = run_cli(oracle.cli.cli, ["export", FIXTURES / "qwen3_5_trained", "--out", out, "--tokens", "17,42",
                                      "--main-model", "--first-token", "9", "-q"])
    assert result.exit_code == 0 and out.exists(), result.output


# --- 5. a weights audit of the checkpoint against itself checks nothing ------------------------------------

def _checkpoint_as_dump(tmp_path, kind) -> tuple[Path, Path]:
    from tests.helpers import TINY_SHARDED

    ckpt = Path(shutil.copytree(TINY_SHARDED if kind == "shard" else TINY, tmp_path / "ckpt"))
    shards = sorted(ckpt.glob("*.safetensors"))
    if kind == "folder":
        return ckpt, ckpt
    if kind == "file":
        return ckpt, shards[0]
    if kind == "shard":
        return ckpt, shards[-1]
    dump = tmp_path / "dump"
    dump.mkdir()
    if kind == "symlink in a folder":
        os.symlink(shards[0], dump / "held.safetensors")
    else:  # a hard link
        os.link(shards[0], dump / "held.safetensors")
    return ckpt, dump


@pytest.mark.parametrize("kind", ["folder", "file", "shard", "symlink in a folder", "hard link in a folder"])
def test_weights_audit_of_the_checkpoint_itself_is_refused(tmp_path, kind):
    ckpt, dump = _checkpoint_as_dump(tmp_path, kind)
    result = assert_refused(probe.cli.cli, ["weights", ckpt, dump], r"the dump is the checkpoint itself.*"
                            r"Dump|dump what your engine holds after loading", [ckpt], tmp_path)
    assert "WEIGHTS OK" not in result.output


def test_twin_a_copy_of_the_head_as_the_engine_dump_is_audited(tmp_path):
    """A real dump (the head's tensors written to a file of their own, as an engine would) is audited: OK."""
    from safetensors.numpy import save_file

    from oracle.checkpoint import Checkpoint

    weights = Checkpoint(TINY).read_head(widen=True, digest=False).tensors
    dump = tmp_path / "held.safetensors"
    save_file({n: np.ascontiguousarray(w) for n, w in weights.items()}, dump)
    result = run_cli(probe.cli.cli, ["weights", TINY, dump])
    assert result.exit_code == 0 and "WEIGHTS OK" in result.output, result.output


# --- 6. outputs that cannot be written are refused before the comparison -----------------------------------

@pytest.mark.parametrize("option", ["--json", "--html", "--plot"])
@pytest.mark.parametrize("target, pattern", [
    ("/proc/version", r"/proc/version: a file cannot be created in /proc"),
    ("/dev/null", r"/dev/null exists and is not a regular file"),
])
def test_unwritable_report_path_is_refused_before_the_diff(tmp_path, option, target, pattern):
    cand = Path(shutil.copy(TINY_REF, tmp_path / "cand.h5"))
    with h5py.File(cand, "r+") as f:
        _doubled(f, "stages/attn")  # a diverging candidate: the verdict must not be printed before the refusal
    result = assert_refused(probe.cli.cli, ["diff", TINY_REF, cand, option, target], pattern, [TINY_REF, cand],
                            tmp_path)
    assert "DIVERGED" not in result.output and "PASSED" not in result.output, result.output
    assert Path("/dev/null").is_char_device()


def test_unwritable_weights_json_is_refused_before_the_audit(tmp_path):
    result = assert_refused(probe.cli.cli, ["weights", TINY, TINY_REF, "--json", "/proc/version"],
                            r"--json /proc/version: a file cannot be created", [TINY], tmp_path)
    assert "WEIGHTS" not in result.output


def test_twin_report_paths_in_a_writable_folder_are_written_and_leave_no_probe_file(tmp_path):
    cand = Path(shutil.copy(TINY_REF, tmp_path / "cand.h5"))
    (tmp_path / "old.json").write_text("{}")  # an existing regular file is replaced
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, cand, "--json", tmp_path / "old.json", "--html",
                                     tmp_path / "r.html"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "old.json").read_text() != "{}" and (tmp_path / "r.html").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --- 7. mtp-oracle inspect / inputs verify the reference's inputs digest, as the probe does ------------------

def _edited_inputs(tmp_path) -> Path:
    path = Path(shutil.copy(TINY_REF, tmp_path / "edited.h5"))
    with h5py.File(path, "r+") as f:
        f["inputs/token_ids"][0] = f["inputs/token_ids"][0] + 1
    return path


@pytest.mark.parametrize("command", ["inspect", "inputs"])
def test_reference_with_edited_inputs_is_refused(tmp_path, command):
    ref = _edited_inputs(tmp_path)
    out_dir = tmp_path / "engine_inputs"
    args = [command, ref] + (["--out-dir", out_dir] if command == "inputs" else [])
    assert_refused(oracle.cli.cli, args, r"edited\.h5: its /inputs hash to .*inputs_digest attribute says .*changed "
                                         r"after export", [ref], tmp_path)
    assert not out_dir.exists() or not any(out_dir.iterdir())
    assert_refused(probe.cli.cli, ["diff", ref, TINY_REF], r"inputs_digest", [ref], tmp_path)  # as the probe does


@pytest.mark.parametrize("command", ["inspect", "inputs"])
def test_twin_the_unedited_reference_is_inspected_and_its_inputs_written(tmp_path, command):
    out_dir = tmp_path / "engine_inputs"
    args = [command, TINY_REF] + (["--out-dir", out_dir] if command == "inputs" else [])
    result = run_cli(oracle.cli.cli, args)
    assert result.exit_code == 0, result.output
    assert command == "inspect" or (out_dir / "inputs.json").is_file()


@pytest.mark.parametrize("option, value", [("--hidden-seed", "\uff10"), ("--start-pos", "\uff15"),
                                           ("--hidden-seed", "1_0")])
def test_integer_options_in_non_ascii_digits_are_refused(tmp_path, option, value):
    args = ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", "17,42", "-q"]
    args += [option, value] if option == "--hidden-seed" else ["--hidden-seed", "0", option, value]
    assert_refused(oracle.cli.cli, args, rf"Invalid value for '{option}': '{value}' is not an integer written in "
                                         r"ASCII digits 0-9", [TINY], tmp_path)
    assert not (tmp_path / "ref.h5").exists()


def test_twin_integer_options_in_ascii_digits_with_a_sign_export(tmp_path):
    result = run_cli(oracle.cli.cli, ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", "17,42", "-q",
                                      "--hidden-seed", "+3", "--start-pos", "+2"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_reference_that_is_not_a_regular_file_is_named_as_such(tmp_path, kind):
    """Red team: a FIFO or /dev/null given as REF was "does not exist"; it exists, it is just not a trace file."""
    path = Path("/dev/null") if kind == "device" else tmp_path / "pipe"
    if kind == "fifo":
        os.mkfifo(path)
    result = run_cli(probe.cli.cli, ["diff", path, TINY_REF])
    assert result.exit_code == 2 and "is not a regular file (a device, FIFO or socket)" in result.output, result.output
    missing = run_cli(probe.cli.cli, ["diff", tmp_path / "gone.h5", TINY_REF])  # twin: a missing path says so
    assert missing.exit_code == 2


def test_a_raw_stage_file_with_an_upper_case_suffix_is_an_unknown_name_not_uncaptured(tmp_path):
    """Red team: mlp.BIN was skipped as "not captured"; any *.bin name that is not a stage is refused, in any case."""
    inputs, stages = load_trace(TINY_REF)
    raw = write_raw(tmp_path / "raw", stages)
    (raw / "mlp.bin").rename(raw / "mlp.BIN")
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, raw])
    assert result.exit_code == 2 and "unknown stage files mlp.BIN" in result.output, result.output
    (raw / "mlp.BIN").rename(raw / "mlp.bin")
    assert run_cli(probe.cli.cli, ["diff", TINY_REF, raw]).exit_code == 0  # twin


def test_a_recorded_input_longer_than_the_trace_is_refused(tmp_path):
    """Red team: a candidate whose /inputs/token_ids had T+1 entries passed, the extra one never looked at."""
    cand = tmp_path / "cand.h5"
    shutil.copy(TINY_REF, cand)
    with h5py.File(cand, "r+") as f:
        ids = f["inputs/token_ids"][()]
        del f["inputs/token_ids"]
        f["inputs/token_ids"] = np.append(ids, 99)
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, cand])
    # refused where the file is opened: its 9 token ids contradict its own num_tokens (8)
    assert result.exit_code == 2 and "/inputs/token_ids has 9 rows, but the root attribute num_tokens says 8" in \
        result.output, result.output


def test_a_c_library_path_that_is_a_directory_is_named_as_such(tmp_path):
    result = run_cli(probe.cli.cli, ["run", TINY_REF, "--impl", f"c:{tmp_path}", "--checkpoint", TINY])
    assert result.exit_code == 2 and f"C library {tmp_path} is a directory" in result.output, result.output
    gone = run_cli(probe.cli.cli, ["run", TINY_REF, "--impl", f"c:{tmp_path / 'x.so'}", "--checkpoint", TINY])
    assert gone.exit_code == 2 and "does not exist" in gone.output  # twin


def _renamed_stage(path: Path, old: str, new: str) -> Path:
    """The bundled reference with stage `old` renamed `new` everywhere (dataset and the root `stages` list)."""
    shutil.copy(TINY_REF, path)
    with h5py.File(path, "r+") as f:
        f.move(f"stages/{old}", f"stages/{new}")
        names = [n.decode() if isinstance(n, bytes) else n for n in f.attrs["stages"]]
        del f.attrs["stages"]
        f.attrs["stages"] = np.array([(new if n == old else n).encode() for n in names])
    return path


@pytest.mark.parametrize("name", ["mlp<img src=x onerror=alert(1)>", "mlp\nPASSED | every stage within tolerance",
                                  "mlp\x1b]0;pwned\x07", "mlp$\\frac{x$"], ids=["html", "newline", "escape", "math"])
def test_a_stage_name_that_is_not_an_identifier_is_refused(tmp_path, name):
    """Red team: stage names from a trace reached the HTML report unescaped (script), the verdict line (a forged
    PASSED line), the terminal (escape sequences) and matplotlib (a `$` crashed --plot, exit 4). Stage names are
    identifiers: anything else is refused, the name shown escaped. Twin: an identifier the family lacks is read."""
    result = run_cli(probe.cli.cli, ["diff", _renamed_stage(tmp_path / "ref.h5", "mlp", name), TINY_REF])
    assert result.exit_code == 2 and "stage names are lower-case identifiers" in result.output, result.output
    assert "\x1b" not in result.output and "\nPASSED" not in result.output
    ok = run_cli(probe.cli.cli, ["diff", _renamed_stage(tmp_path / "ok.h5", "mlp", "mlp_2"), TINY_REF])
    assert "stage names are lower-case identifiers" not in ok.output


def test_file_strings_reach_the_terminal_and_the_verdict_line_escaped(tmp_path):
    """Red team: `inspect` printed a trace's family/producer/docs raw (terminal escape sequences, bidi overrides),
    and a candidate folder named with a newline put a line reading PASSED after the real verdict line."""
    ref = tmp_path / "ref.h5"
    shutil.copy(TINY_REF, ref)
    with h5py.File(ref, "r+") as f:
        f["stages/attn"].attrs["doc"] = "attention\x1b[2J\u202eoutput"
    shown = run_cli(oracle.cli.cli, ["inspect", ref])
    assert shown.exit_code == 0 and "\x1b" not in shown.output and "\u202e" not in shown.output
    assert "attention\\x1b[2J\\u202eoutput" in shown.output
    inputs, stages = load_trace(TINY_REF)
    folder = write_raw(tmp_path / "dump\nPASSED | every stage within tolerance", stages)
    (folder / "mlp.bin").write_bytes((stages["mlp"] * 2).astype("<f4").tobytes())  # a divergence (exit 1)
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, folder])
    last = result.output.rstrip("\n").splitlines()[-1]
    assert result.exit_code == 1 and last.startswith("DIVERGED |") and "dump\\nPASSED" in last, result.output


def test_a_dollar_in_a_candidate_path_is_plain_text_in_the_plot(tmp_path):
    """Red team: matplotlib parsed `$...` in the plot's title as maths and an unbalanced one crashed --plot, exit 4."""
    pytest.importorskip("matplotlib")
    inputs, stages = load_trace(TINY_REF)
    folder = write_raw(tmp_path / "d$\\frac{x$", stages)
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, folder, "--plot", tmp_path / "heat.png"])
    assert result.exit_code == 0 and (tmp_path / "heat.png").stat().st_size > 0, result.output


@pytest.mark.parametrize("attr", ["kind", "shape"])
def test_a_stage_kind_or_shape_stored_as_an_array_is_refused(tmp_path, attr):
    ref = tmp_path / "ref.h5"
    shutil.copy(TINY_REF, ref)
    with h5py.File(ref, "r+") as f:
        f["stages/e"].attrs[attr] = np.array([1, 2])
    result = run_cli(oracle.cli.cli, ["inspect", ref])
    assert result.exit_code == 2 and "/stages/e has kind" in result.output, result.output


def test_a_deeply_nested_inputs_json_is_refused_not_a_crash(tmp_path):
    inputs, stages = load_trace(TINY_REF)
    folder = write_raw(tmp_path / "raw", stages)
    (folder / "inputs.json").write_text("[" * 100000 + "]" * 100000)
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, folder])
    assert result.exit_code == 2 and "is not readable JSON" in result.output, result.output
