"""Bad inputs and faults, through the real CLIs: never a traceback, never exit 1, never a lost or leftover file.

Every corpus case asserts the same five things: exit 2, no "Traceback", a message naming the bad thing, no
`.tmp-` file left anywhere, and every input file byte-identical afterwards. Each class of cause has a twin: the
good version of the same input still works.
"""

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import oracle.cli
import oracle.limits
import oracle.output
import probe.cli
from oracle.families.qwen3_5_layout import head_config_from_json
from oracle.limits import check_export_limits, estimate_bytes, largest_fitting_tokens
from tests.helpers import ROOT, TINY, TINY_REF, TINY_SHARDED, run_cli

TOKENS = "17,42,3,255"
SEED = ("--hidden-seed", "0")


# --- helpers -------------------------------------------------------------------------------------------------

def digests(paths) -> dict[str, str]:
    """sha256 of every file under `paths` (files or directories)."""
    found = {}
    for path in map(Path, paths):
        for f in ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())):
            found[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def leftovers(*dirs) -> list[Path]:
    return [p for d in dirs for p in Path(d).rglob("*") if ".tmp-" in p.name]


def assert_refused(cli, args, pattern, inputs, tmp_path, code=2):
    """Run `cli args`; assert exit `code`, no traceback, `pattern` in the output, no .tmp- file, inputs unchanged."""
    before = digests(inputs)
    result = run_cli(cli, args)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "Exception ignored" not in result.output, result.output
    assert re.search(pattern, result.output), result.output
    assert not leftovers(tmp_path, *[Path(p).parent for p in inputs]), leftovers(tmp_path)
    assert digests(inputs) == before, "an input file changed"
    return result


def checkpoint_copy(tmp_path, source=TINY, name="ckpt") -> Path:
    return Path(shutil.copytree(source, tmp_path / name))


def edit_config(ckpt: Path, edit) -> Path:
    raw = json.loads((ckpt / "config.json").read_text())
    edit(raw, raw["text_config"])
    (ckpt / "config.json").write_text(json.dumps(raw))
    return ckpt


class Replace:
    """Returned by a header edit: the header becomes `value` (other edits change it in place)."""

    def __init__(self, value):
        self.value = value


def edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors file with its header JSON edited in place (the data bytes stay as they are)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edited = edit(header)
    header = edited.value if isinstance(edited, Replace) else header
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


def edit_trace(tmp_path, edit, name="bad.h5") -> Path:
    path = Path(shutil.copy(TINY_REF, tmp_path / name))
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def export_args(ckpt, out, *rest):
    return ["export", ckpt, "--out", out, *rest, "-q"]


# --- 1. exit codes -------------------------------------------------------------------------------------------

def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("exc, code", [(ZeroDivisionError("boom"), 4), (KeyError("k"), 4), (EOFError(), 4),
                                       (GeneratorExit("closed"), 4), (asyncio.CancelledError(), 4),
                                       (KeyboardInterrupt(), 130)])
def test_uncaught_exceptions_never_exit_1(monkeypatch, exc, code):
    monkeypatch.setattr("oracle.inspect.render_inspection", _raise(exc))
    result = run_cli(oracle.cli.cli, ["inspect", TINY_REF])
    assert result.exit_code == code, result.output
    if code == 4:
        assert "Traceback" in result.output and "internal error: this is a bug in mtp-probe" in result.output
    else:
        assert "Interrupted" in result.output and "Traceback" not in result.output


def test_probe_internal_error_exits_4(monkeypatch):
    monkeypatch.setattr("probe.diff.diff_traces", _raise(RuntimeError("a bug")))  # probe.cli imports it in `diff`
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, TINY_REF])
    assert result.exit_code == 4 and "RuntimeError: a bug" in result.output and "internal error" in result.output


def test_usage_errors_stay_exit_2():
    assert run_cli(probe.cli.cli, ["diff", TINY_REF]).exit_code == 2
    assert run_cli(oracle.cli.cli, ["export", "--no-such-option"]).exit_code == 2


# --- 2. outputs that are inputs ------------------------------------------------------------------------------

def _out_onto_input_cases():
    def ckpt_file(name):
        return lambda tmp, ck: (export_args(ck, ck / name, "--tokens", TOKENS, *SEED), "checkpoint file " + name)

    def linked(kind):
        def case(tmp, ck):
            link = tmp / f"{kind}.h5"
            (os.symlink if kind == "symlink" else os.link)(ck / "model.safetensors", link)
            return export_args(ck, link, "--tokens", TOKENS, *SEED), "checkpoint file model.safetensors"
        return case

    def hidden(tmp, ck):
        np.save(tmp / "h.npy", np.zeros((4, 64), np.float32))
        return export_args(ck, tmp / "h.npy", "--tokens", TOKENS, "--hidden", tmp / "h.npy"), "--hidden file"

    def hidden_h5(tmp, ck):
        with h5py.File(tmp / "h.h5", "w") as f:
            f["h"] = np.zeros((4, 64), np.float32)
        os.link(tmp / "h.h5", tmp / "hard.h5")
        return export_args(ck, tmp / "hard.h5", "--tokens", TOKENS, "--hidden", f"{tmp / 'h.h5'}:/h"), "--hidden"

    def tokens_file(tmp, ck):
        (tmp / "t.txt").write_text(TOKENS)
        return export_args(ck, tmp / "t.txt", "--tokens-file", tmp / "t.txt", *SEED), "--tokens-file"

    return {"model.safetensors": ckpt_file("model.safetensors"), "config.json": ckpt_file("config.json"),
            "symlink": linked("symlink"), "hardlink": linked("hardlink"), "hidden": hidden,
            "hidden_h5_hardlink": hidden_h5, "tokens_file": tokens_file}


OUT_ONTO_INPUT = _out_onto_input_cases()


@pytest.mark.parametrize("case", sorted(OUT_ONTO_INPUT))
def test_export_out_onto_an_input_is_refused(tmp_path, case):
    ckpt = checkpoint_copy(tmp_path)
    args, pattern = OUT_ONTO_INPUT[case](tmp_path, ckpt)
    assert_refused(oracle.cli.cli, args, re.escape(pattern) + ".*destroy an input", [ckpt, *tmp_path.glob("*.*")],
                   tmp_path)


def test_export_out_onto_a_shard_or_the_index_is_refused(tmp_path):
    ckpt = checkpoint_copy(tmp_path, TINY_SHARDED)
    for name in ("model-00002-of-00003.safetensors", "model.safetensors.index.json"):
        assert_refused(oracle.cli.cli, export_args(ckpt, ckpt / name, "--tokens", TOKENS, *SEED),
                       f"checkpoint file {re.escape(name)}", [ckpt], tmp_path)


def _probe_cases(tmp_path):
    ref = Path(shutil.copy(TINY_REF, tmp_path / "ref.h5"))
    cand = Path(shutil.copy(TINY_REF, tmp_path / "cand.h5"))
    raw = tmp_path / "raw"
    raw.mkdir()
    with h5py.File(ref) as f:
        for name in f["stages"]:
            f[f"stages/{name}"][()].astype("<f4").tofile(raw / f"{name}.bin")
    link = tmp_path / "link.json"
    link.symlink_to(ref)
    return ref, cand, raw, {
        "diff --json REF": (["diff", ref, cand, "--json", ref], "--json .* is the REF"),
        "diff --plot CANDIDATE": (["diff", ref, cand, "--plot", cand], "--plot .* is the CANDIDATE"),
        "diff --json symlink to REF": (["diff", ref, cand, "--json", link], "--json .* is the REF"),
        "diff --json into a raw candidate": (["diff", ref, raw, "--json", raw / "out.bin"], "CANDIDATE file out.bin"),
        "diff --json == --plot": (["diff", ref, cand, "--json", tmp_path / "r", "--plot", tmp_path / "r"],
                                  "--plot .* is the output of --json"),
        "run --out REF": (["run", ref, "--impl", "torch", "--checkpoint", TINY, "--out", ref], "--out .* is the REF"),
        "run --json checkpoint": (["run", ref, "--impl", "torch", "--checkpoint", TINY, "--json",
                                   TINY / "config.json"], "checkpoint file config.json"),
    }


def test_probe_outputs_onto_inputs_are_refused(tmp_path):
    ref, cand, raw, cases = _probe_cases(tmp_path)
    (raw / "out.bin").write_bytes(b"")  # an existing file of the raw candidate directory
    for name, (args, pattern) in cases.items():
        result = assert_refused(probe.cli.cli, args, pattern + ".*destroy an input", [ref, cand, raw, TINY],
                                tmp_path)
        assert result.exit_code == 2, name


def test_accept_outputs_onto_inputs_are_refused(tmp_path):
    tokens = Path(shutil.copy(ROOT / "fixtures/qwen3_5_trained/heldout_tokens.txt", tmp_path / "t.txt"))
    base = ["accept", ROOT / "fixtures/qwen3_5_trained", "--tokens-file", tokens, "--hidden-seed", "0", "-q"]
    assert_refused(oracle.cli.cli, [*base, "--json", tokens], "--json .* is the --tokens-file", [tokens], tmp_path)
    assert_refused(oracle.cli.cli, [*base, "--plot", tmp_path / "x", "--json", tmp_path / "x"],
                   "is the output of --json", [tokens], tmp_path)


def test_twin_outputs_beside_inputs_are_written(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    result = run_cli(oracle.cli.cli, export_args(ckpt, ckpt / "ref.h5", "--tokens", TOKENS, *SEED))
    assert result.exit_code == 0, result.output
    result = run_cli(probe.cli.cli, ["diff", ckpt / "ref.h5", ckpt / "ref.h5", "--json", tmp_path / "r.json"])
    assert result.exit_code in (0, 3) and json.loads((tmp_path / "r.json").read_text())["schema"]


# --- 3. disk full, I/O errors, stale temporaries --------------------------------------------------------------

def test_disk_full_during_export_exit_2_and_nothing_left(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE), in a child process: HDF5 fails while flushing and in close."""
    out = tmp_path / "ref.h5"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
            "from oracle.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "export", str(TINY), "--out", str(out), "--tokens", TOKENS,
                           *SEED, "-q"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no space left on" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_disk_full_simulated_in_hdf5_write(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError("Can't write data (file write failed: errno = 28, error message = 'No space left on device')")

    monkeypatch.setattr(h5py.Group, "create_dataset", full)
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, export_args(TINY, out, "--tokens", TOKENS, *SEED),
                   f"no space left on {re.escape(str(tmp_path))}", [TINY], tmp_path)
    assert not out.exists()


def test_verdict_printed_when_the_json_report_cannot_be_written(tmp_path, monkeypatch):
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith(".json"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(oracle.output.os, "replace", full)
    result = assert_refused(probe.cli.cli, ["diff", TINY_REF, TINY_REF, "--json", tmp_path / "r.json"],
                            "no space left on", [TINY_REF], tmp_path)
    stdout = result.stdout.strip().splitlines()
    assert re.match(r"(PASSED|INCONCLUSIVE|DIVERGED|INVALID) \|", stdout[-1]), result.stdout
    assert not (tmp_path / "r.json").exists()


def test_stale_temporary_of_a_killed_run_is_removed(tmp_path):
    out = tmp_path / "ref.h5"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ref.h5.tmp-{dead.pid}"
    stale.write_bytes(b"half a trace")
    alive = tmp_path / f".ref.h5.tmp-{os.getppid()}"  # a live process's file is not ours to remove
    alive.write_bytes(b"in progress")
    result = run_cli(oracle.cli.cli, export_args(TINY, out, "--tokens", TOKENS, *SEED))
    assert result.exit_code == 0, result.output
    assert not stale.exists() and alive.exists() and out.exists()


# --- 4. Ctrl-C -------------------------------------------------------------------------------------------------

def test_sigint_while_writing_the_trace_ends_130_without_a_file(tmp_path, monkeypatch):
    """The signal arrives inside HDF5 writes; it is held, the temporary file removed, then the interrupt wins."""
    real = h5py.Group.create_dataset
    calls = []

    def create_then_interrupt(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", create_then_interrupt)
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, export_args(TINY, out, "--tokens", TOKENS, *SEED), "Interrupted", [TINY],
                   tmp_path, code=130)
    assert len(calls) > 3 and not out.exists(), "the write was not held to its end, or the file was kept"


def test_sigint_at_any_moment_of_an_export(tmp_path):
    """Real SIGINTs at several delays (imports, compute, write): 130 and no file, or 0 and a complete file."""
    tokens = ",".join(str(i % 500) for i in range(1500))
    procs = []
    for delay in (1.0, 2.5, 4.0):
        out = tmp_path / f"ref{delay}.h5"
        proc = subprocess.Popen([sys.executable, "-m", "oracle", "export", str(TINY), "--out", str(out),
                                 "--tokens", tokens, *SEED, "-q"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        procs.append((delay, out, proc))
    start = time.monotonic()
    for delay, out, proc in procs:
        time.sleep(max(0.0, start + delay - time.monotonic()))
        proc.send_signal(signal.SIGINT)
    for delay, out, proc in procs:
        stderr = proc.communicate(timeout=120)[1]
        assert proc.returncode in (130, 0), (delay, proc.returncode, stderr)
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
        if proc.returncode == 130:
            assert not out.exists()
        else:
            with h5py.File(out) as f:
                assert f.attrs["num_tokens"] == 1500
    assert not leftovers(tmp_path)


def test_sigint_as_the_trace_is_written(tmp_path):
    """A real SIGINT sent the moment the export says it is writing (the write itself takes milliseconds)."""
    out = tmp_path / "ref.h5"
    tokens = ",".join(str(i % 500) for i in range(1500))
    proc = subprocess.Popen([sys.executable, "-m", "oracle", "export", str(TINY), "--out", str(out), "--tokens",
                             tokens, *SEED], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("writing"):
            proc.send_signal(signal.SIGINT)
            break
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode in (130, 0) and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert out.exists() == (proc.returncode == 0) and not leftovers(tmp_path)


# --- 5 and 6. positions and sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("start, pattern", [
    (4095, "positions run to 4098, but positions must be below 4096.*max_position_embeddings is 4096"),
    (2**24, "2\\*\\*24"),
    (2**40, "2\\*\\*24"),
    (2**63 - 2, "do(es)? not fit|int64"),
    (2**70, "int64"),
])
def test_positions_beyond_what_rope_represents_are_refused(tmp_path, start, pattern):
    out = tmp_path / "ref.h5"
    assert_refused(oracle.cli.cli, export_args(TINY, out, "--tokens", TOKENS, *SEED, "--start-pos", str(start)),
                   pattern, [TINY], tmp_path)


def test_float32_bound_applies_when_the_config_allows_more(tmp_path):
    cfg = head_config_from_json(json.loads((TINY / "config.json").read_text()), "c")
    long = type(cfg)(**{**cfg.to_dict(), "max_position_embeddings": 2**30})
    with pytest.raises(Exception, match="float32 holds integers exactly only below 2\\*\\*24"):
        check_export_limits(long, 4, 2**24 - 2, available=1 << 40)
    check_export_limits(long, 4, 2**24 - 4, available=1 << 40)  # twin: the last exact positions are allowed


def test_twin_last_allowed_position_exports(tmp_path):
    out = tmp_path / "ref.h5"
    result = run_cli(oracle.cli.cli, export_args(TINY, out, "--tokens", TOKENS, *SEED, "--start-pos", "4092"))
    assert result.exit_code == 0, result.output


def test_memory_estimate_refuses_with_the_largest_t_that_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(oracle.limits, "available_memory", lambda: 64 << 20)
    out = tmp_path / "ref.h5"
    tokens = ",".join(["5"] * 3000)
    result = assert_refused(oracle.cli.cli, export_args(TINY, out, "--tokens", tokens, *SEED),
                            r"T=3000 steps in --mode batched need about .* Export at most (\d+) tokens, or use "
                            r"--mode stepwise", [TINY], tmp_path)
    fits = int(re.search(r"at most (\d+) tokens", result.output).group(1))
    cfg = head_config_from_json(json.loads((TINY / "config.json").read_text()), "c")
    assert estimate_bytes(cfg, fits, "batched") <= 64 << 20 < estimate_bytes(cfg, fits + 1, "batched")
    assert largest_fitting_tokens(cfg, "stepwise", 64 << 20) > 3000  # stepwise is linear: it would fit
    # T = 100000 (the 8 GB run) is refused at once on any machine this runs on
    assert estimate_bytes(cfg, 100_000, "batched") > 300 << 30


# --- 7. inputs validated where they are read ------------------------------------------------------------------

CONFIG_CASES = {
    "text_config null": (lambda raw, t: raw.update(text_config=None), "text_config is null"),
    "text_config list": (lambda raw, t: raw.update(text_config=[t]), "text_config is a list"),
    "rope_theta string": (lambda raw, t: t["rope_parameters"].update(rope_theta="1e7"), "rope_theta must be"),
    "rope_parameters string": (lambda raw, t: t.update(rope_parameters="default"), "rope_parameters is a string"),
    "head_dim null": (lambda raw, t: t.update(head_dim=None), "head_dim must be a positive integer, found None"),
    "head_dim 32.7": (lambda raw, t: t.update(head_dim=32.7), "head_dim must be a positive integer, found 32.7"),
    "head_dim true": (lambda raw, t: t.update(head_dim=True), "head_dim must be a positive integer, found True"),
    # json.dumps writes Infinity, which the JSON reader refuses before the family's check (oracle/reading.py)
    "rms_norm_eps inf": (lambda raw, t: t.update(rms_norm_eps=float("inf")),
                         "rms_norm_eps must be .* finite|is refused: Infinity is not a JSON number"),
    "hidden_size bool": (lambda raw, t: t.update(hidden_size=True), "hidden_size must be a positive integer"),
    "mrope_section str": (lambda raw, t: t["rope_parameters"].update(mrope_section="2,1,1"), "mrope_section"),
    "max_position string": (lambda raw, t: t.update(max_position_embeddings="4096"), "max_position_embeddings"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_values_of_the_wrong_type(tmp_path, case):
    edit, pattern = CONFIG_CASES[case]
    ckpt = edit_config(checkpoint_copy(tmp_path), edit)
    assert_refused(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED),
                   "config.json: " + pattern, [ckpt], tmp_path)


def test_twin_config_with_every_field_explicit_and_right(tmp_path):
    def explicit(raw, t):
        t.update(head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096)
    ckpt = edit_config(checkpoint_copy(tmp_path), explicit)
    assert run_cli(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED)).exit_code == 0


def _unreadable_config(kind):
    def make(ckpt: Path):
        config = ckpt / "config.json"
        config.unlink()
        if kind == "directory":
            config.mkdir()
        elif kind == "symlink loop":
            config.symlink_to(ckpt / "loop.json")
            (ckpt / "loop.json").symlink_to(config)
        return ckpt
    return make


@pytest.mark.parametrize("kind", ["directory", "symlink loop"])
def test_config_json_that_cannot_be_read(tmp_path, kind):
    ckpt = _unreadable_config(kind)(checkpoint_copy(tmp_path))
    assert_refused(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED),
                   "cannot read .*config.json", [ckpt / "model.safetensors"], tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_config_json_without_permission(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    (ckpt / "config.json").chmod(0)
    assert_refused(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED),
                   "cannot read .*config.json", [ckpt / "model.safetensors"], tmp_path)


HEADER_CASES = {
    "not an object": (lambda h: Replace([1, 2]), "header is list, not a JSON object"),
    "entry not an object": (lambda h: h.update({"mtp.norm.weight": 5}), "'mtp.norm.weight' is int"),
    "no data_offsets": (lambda h: h["mtp.norm.weight"].pop("data_offsets"), "data_offsets None"),
    "dtype not a string": (lambda h: h["mtp.norm.weight"].update(dtype=2), "dtype 2, not a string"),
    "shape not ints": (lambda h: h["mtp.norm.weight"].update(shape=["64"]), "shape \\['64'\\]"),
    "offsets reversed": (lambda h: h["mtp.norm.weight"].update(data_offsets=h["mtp.norm.weight"]["data_offsets"][::-1]),
                         "0 <= start <= end"),
    "offsets negative": (lambda h: h["mtp.norm.weight"].update(data_offsets=[-128, 0]), "0 <= start <= end"),
    "offsets short of the shape": (lambda h: h["mtp.norm.weight"].update(shape=[65]), "but BF16 \\[65\\] needs 130"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_safetensors_header_of_the_wrong_shape(tmp_path, case):
    edit, pattern = HEADER_CASES[case]
    ckpt = checkpoint_copy(tmp_path)
    edit_header(ckpt / "model.safetensors", edit)
    assert_refused(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED), pattern,
                   [ckpt], tmp_path)


def test_index_whose_values_are_not_file_names(tmp_path):
    ckpt = checkpoint_copy(tmp_path, TINY_SHARDED)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.norm.weight"] = 3
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED),
                   r"weight_map\['mtp.norm.weight'\] is 3", [ckpt], tmp_path)


def test_twin_rewritten_header_still_reads(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    edit_header(ckpt / "model.safetensors", lambda h: None)
    assert run_cli(oracle.cli.cli, export_args(ckpt, tmp_path / "o.h5", "--tokens", TOKENS, *SEED)).exit_code == 0


def _tokens_file(tmp_path, content: bytes, name="t.txt"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content, name, pattern", [
    (b"", "t.txt", "is empty"),
    (b" \n\t", "t.txt", "is empty"),
    (b"5,\xff\xfe,3", "t.txt", "is not UTF-8 text"),
    (b"5, 99999999999999999999999", "t.txt", "token id 99999999999999999999999 at row 1 does not fit in int64"),
    (None, "t.npy", "holds no token ids"),
    ("uint64", "t.npy", "token id 18446744073709551615 at row 1 does not fit in int64"),
])
def test_bad_tokens_files(tmp_path, content, name, pattern):
    if content is None:
        np.save(tmp_path / name, np.zeros(0, np.int64))
    elif content == "uint64":
        np.save(tmp_path / name, np.array([5, 2**64 - 1], np.uint64))
    else:
        _tokens_file(tmp_path, content, name)
    assert_refused(oracle.cli.cli, export_args(TINY, tmp_path / "o.h5", "--tokens-file", tmp_path / name, *SEED),
                   pattern, [tmp_path / name], tmp_path)


@pytest.mark.parametrize("args, pattern", [
    (["--tokens", "5,-99999999999999999999999"], "does not fit in int64"),
    (["--tokens", "5,1e3"], "'1e3' is not an integer token id"),
    (["--tokens", "5", "--hidden-seed", "-1"], "--hidden-seed -1 is negative"),
    (["--tokens", "5", "--main-model", "--first-token", str(2**70)], "--first-token"),
])
def test_bad_token_and_seed_options(tmp_path, args, pattern):
    args = args if "--hidden-seed" in args else [*args, *SEED]
    assert_refused(oracle.cli.cli, export_args(TINY, tmp_path / "o.h5", *args), pattern, [TINY], tmp_path)


def test_twin_tokens_file_and_h5_hidden(tmp_path):
    tokens = _tokens_file(tmp_path, b"17 42\n3,255\n")
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f["h"] = np.ones((4, 64), np.float32)
    result = run_cli(oracle.cli.cli, export_args(TINY, tmp_path / "o.h5", "--tokens-file", tokens,
                                                 "--hidden", f"{tmp_path / 'h.h5'}:/h"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("value", ["a string", np.array([b"x"] * 4)])
def test_hidden_dataset_holding_strings(tmp_path, value):
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f["h"] = value
    assert_refused(oracle.cli.cli, export_args(TINY, tmp_path / "o.h5", "--tokens", TOKENS, "--hidden",
                                               f"{tmp_path / 'h.h5'}:/h"), "h.h5:/h is (text|bytes|objects)",
                   [tmp_path / "h.h5"], tmp_path)


def _set_attr(key, value):
    def edit(f):
        f.attrs[key] = value
    return edit


def _stage_group(f):
    del f["stages/attn"]
    f.create_group("stages/attn")


def _stages_dataset(f):
    del f["stages"]
    f["stages"] = np.zeros(3)


def _zero_tokens(f):
    f.attrs["num_tokens"] = 0


def _replace(name, value):
    def edit(f):
        del f[name]
        f[name] = value
    return edit


TRACE_CASES = {
    "stage of strings": (_replace("stages/attn", np.array([b"x"] * 8)), r"/stages/attn holds \|S1"),
    "stage scalar": (_replace("stages/out", np.float32(1)), r"/stages/out holds float32 \[\]"),
    "token_ids strings": (_replace("inputs/token_ids", np.array([b"7"] * 8)), "/inputs/token_ids holds"),
    "config not JSON": (_set_attr("config", "{not json"), "'config' must be a string holding a JSON object"),
    "config JSON list": (_set_attr("config", "[1, 2]"), "'config' must be a string holding a JSON object"),
    "provenance integer": (_set_attr("provenance", 7), "'provenance' must be a string holding a JSON object"),
    "versions not JSON": (_set_attr("versions", "torch"), "'versions' must be a string holding a JSON object"),
    "num_tokens string": (_set_attr("num_tokens", "8"), "'num_tokens' must be an integer"),
    "num_tokens float": (_set_attr("num_tokens", 8.0), "'num_tokens' must be an integer"),
    "hidden_size negative": (_set_attr("hidden_size", -64), "'hidden_size' must be a positive integer"),
    "stages a number": (_set_attr("stages", 5), "'stages' must be a list of stage names"),
    "digest a number": (_set_attr("inputs_digest", 5), "'inputs_digest' is int64"),
    "group as a stage": (_stage_group, "/stages/attn is a group where a dataset belongs"),
    "stages a dataset": (_stages_dataset, "/stages is a dataset"),
    "T=0": (_zero_tokens, "the trace has no tokens"),
}


@pytest.mark.parametrize("case", sorted(TRACE_CASES))
def test_trace_attributes_of_the_wrong_type(tmp_path, case):
    edit, pattern = TRACE_CASES[case]
    bad = edit_trace(tmp_path, edit)
    ref = Path(shutil.copy(TINY_REF, tmp_path / "ref.h5"))
    for cli, args in ((probe.cli.cli, ["diff", bad, ref]), (probe.cli.cli, ["diff", ref, bad]),
                      (oracle.cli.cli, ["inspect", bad])):
        assert_refused(cli, args, pattern, [bad, ref], tmp_path)


def test_twin_trace_with_rewritten_attributes_reads(tmp_path):
    def rewrite(f):
        for key in ("config", "provenance", "versions"):
            f.attrs[key] = json.dumps(json.loads(f.attrs[key]))
        f.attrs["num_tokens"] = np.int32(8)
    good = edit_trace(tmp_path, rewrite)
    assert run_cli(probe.cli.cli, ["diff", TINY_REF, good]).exit_code in (0, 3)


@pytest.mark.parametrize("backend", ["bogus", None])
def test_plot_with_a_broken_backend_or_without_matplotlib(tmp_path, monkeypatch, backend):
    if backend is None:  # matplotlib missing: its import fails
        for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        pattern = "--plot needs matplotlib"
    else:
        for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, name)  # a fresh import reads MPLBACKEND
        monkeypatch.setenv("MPLBACKEND", backend)
        pattern = None
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, TINY_REF, "--plot", tmp_path / "p.png"])
    assert "Traceback" not in result.output and not leftovers(tmp_path), result.output
    if pattern:
        assert result.exit_code == 2 and pattern in result.output and not (tmp_path / "p.png").exists()
        assert re.search(r"^(PASSED|INCONCLUSIVE) \|", result.stdout.splitlines()[-1]), result.output  # verdict printed
    else:  # the plot never uses a backend: a broken MPLBACKEND does not matter
        assert result.exit_code in (0, 3) and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG", result.output


def test_closed_stdout_is_not_an_internal_error():
    """`mtp-probe diff ... | head -1`: the reader went away; exit 141 (SIGPIPE's shell status) without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-c", "from probe.cli import main; main()", "diff", str(TINY_REF),
                               str(TINY_REF)], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
        proc.stderr
