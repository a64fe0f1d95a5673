"""Issue 29, "Faults and bad input" (round 3): the checkpoint changing under an export, sizes files claim, malformed
values, outputs that change what an input means, and the smaller points. Every case runs the real CLI (in a
subprocess where the fault could kill or hang the process) and asserts exit 2, a message naming the file, no
traceback, no leftover, inputs unchanged; each cause has its honest twin."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import oracle.cli
import probe.cli
from oracle.checkpoint import Checkpoint
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli
from tests.test_bad_inputs import assert_refused, checkpoint_copy, digests, leftovers

MOE = FIXTURES / "qwen3_5_moe_tiny"
TOKENS = "17,42,3,255"


def run_program(args, timeout=120, env=None, code=None) -> subprocess.CompletedProcess:
    """`python -c code args` (default: the mtp-oracle CLI as the program), in a subprocess: a fault that kills or
    hangs the process fails this test, not the suite."""
    code = code or "import sys; from oracle.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_exit_2(result, pattern, *dirs):
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    assert pattern in out, out
    assert not leftovers(*dirs), leftovers(*dirs)


# --- cause 2: the digest vouches for the bytes used; a checkpoint cut short is exit 2, not SIGBUS --------------

# A fault injected at a named moment of a real export (the CLI as the program): "before-read" just before the
# head's bytes are read, "after-forward" once the stages are computed. "truncate" halves the shard, "rewrite"
# overwrites the head's first tensor in place (same size, so only the bytes and the times change).
_FAULT_DRIVER = """
import os, sys
from pathlib import Path
import oracle.checkpoint, oracle.export
shard, when, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def fault():
    if how == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "rewrite":
        entry = min(oracle.checkpoint._read_safetensors_header(shard).values(), key=lambda e: e.offset)
        with open(shard, "r+b") as f:
            f.seek(entry.offset)
            f.write(b"\\x3f" * entry.nbytes)
def wrap(owner, name):
    real = getattr(owner, name)
    def hooked(*a, **k):
        if when == "before-read" and name == "check_head":
            out = real(*a, **k); fault(); return out
        if when == "after-forward" and name == "check_finite_reference":
            fault()
        return real(*a, **k)
    setattr(owner, name, hooked)
wrap(oracle.checkpoint.Checkpoint, "check_head")
wrap(oracle.export, "check_finite_reference")
from oracle.cli import main
main(sys.argv[4:])
"""


def _export_with_fault(ckpt: Path, out: Path, when: str, how: str):
    return run_program([ckpt / "model.safetensors", when, how, "export", ckpt, "--out", out, "--tokens", TOKENS,
                        "--hidden-seed", "0", "-q"], code=_FAULT_DRIVER)


@pytest.mark.parametrize("source, when", [(TINY, "before-read"), (TINY, "after-forward"), (MOE, "before-read")],
                         ids=["dense-before-read", "dense-after-forward", "moe-before-read"])
def test_a_checkpoint_cut_short_during_an_export_is_exit_2_naming_the_shard(tmp_path, source, when):
    ckpt = checkpoint_copy(tmp_path, source)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", when, "truncate")
    assert result.returncode != -7, "SIGBUS: a mapped page past the new end of the shard was read"
    assert_exit_2(result, str(ckpt / "model.safetensors"), tmp_path)
    assert not (tmp_path / "ref.h5").exists()


def test_a_checkpoint_cut_short_while_the_chains_read_its_mapped_head_is_exit_2_naming_the_shard(tmp_path):
    # The export reads the dense head through the shard's mapping (oracle/sigbus.py): cut after the bridge, the
    # chains then touch pages past the new end. The SIGBUS guard's message, not check_unchanged's: the fault hit.
    ckpt = checkpoint_copy(tmp_path)
    result = run_program([ckpt / "model.safetensors", "after-forward", "truncate", "export", ckpt, "--out",
                          tmp_path / "ref.h5", "--tokens", TOKENS, "--hidden-seed", "0", "-q", "--chain", "2"],
                         code=_FAULT_DRIVER)
    assert result.returncode != -7, "SIGBUS: a mapped page past the new end of the shard was read"
    assert_exit_2(result, str(ckpt / "model.safetensors"), tmp_path)
    assert "a page of its tensors lies past the file's new end" in result.stderr, result.stderr
    assert not (tmp_path / "ref.h5").exists()


def test_twin_the_same_chained_export_undisturbed_writes_its_trace(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    result = run_program([ckpt / "model.safetensors", "none", "none", "export", ckpt, "--out", tmp_path / "ref.h5",
                          "--tokens", TOKENS, "--hidden-seed", "0", "-q", "--chain", "2"], code=_FAULT_DRIVER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "ref.h5").is_file()


@pytest.mark.parametrize("when", ["before-read", "after-forward"])
def test_a_checkpoint_rewritten_in_place_during_an_export_is_refused(tmp_path, when):
    ckpt = checkpoint_copy(tmp_path)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", when, "rewrite")
    assert_exit_2(result, "changed while it was being read", tmp_path)
    assert not (tmp_path / "ref.h5").exists()


def test_twin_an_undisturbed_export_records_the_digest_of_the_checkpoint(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    result = _export_with_fault(ckpt, tmp_path / "ref.h5", "none", "none")
    assert result.returncode == 0, result.stdout + result.stderr
    with h5py.File(tmp_path / "ref.h5") as f:
        recorded = f.attrs["checkpoint_digest"]
    assert (recorded.decode() if isinstance(recorded, bytes) else recorded) == Checkpoint(ckpt).head_digest()


def _sha256_of(weights) -> str:
    """Checkpoint.digest's formula over the arrays the head is built from."""
    digest = hashlib.sha256()
    for name in sorted(weights.layout.dense):
        stored = weights.tensors[name]
        digest.update(f"{name}|{weights.dtypes[name]}|{list(stored.shape)}|".encode())
        digest.update(np.ascontiguousarray(stored).tobytes())
    return "sha256:" + digest.hexdigest()


def test_the_digest_is_of_the_bytes_the_head_is_built_from_even_if_the_file_changes(tmp_path):
    """The head's arrays are the bytes that were hashed: rewriting the shard afterwards (in place, same size)
    changes neither them nor the digest; it changes the file's own digest and is seen by check_unchanged."""
    ckpt_dir = checkpoint_copy(tmp_path)
    ckpt = Checkpoint(ckpt_dir)
    weights = ckpt.read_head(widen=False, digest=True)
    before = {n: np.array(a) for n, a in weights.tensors.items() if n in weights.layout.dense}
    shard = ckpt_dir / "model.safetensors"
    entry = ckpt.entry(sorted(weights.layout.dense)[0])
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        f.write(b"\x3f" * entry.nbytes)
    assert _sha256_of(weights) == weights.digest  # the bytes used are the bytes hashed
    for name, values in before.items():
        np.testing.assert_array_equal(weights.tensors[name], values, err_msg=name)
    assert ckpt.head_digest() == weights.digest  # what this Checkpoint read
    assert Checkpoint(ckpt_dir).head_digest() != weights.digest  # the file now holds other bytes
    with pytest.raises(Exception, match="changed while it was being read"):
        ckpt.check_unchanged()


def test_twin_an_unchanged_checkpoint_passes_check_unchanged(tmp_path):
    ckpt = Checkpoint(checkpoint_copy(tmp_path))
    ckpt.read_head(widen=False, digest=True)
    ckpt.check_unchanged()


# --- cause 4: sizes that files claim are not trusted; FIFOs are refused; accept and run estimate memory ------------

def _claims_rows(path: Path, rows: int, num_tokens: int | None = None) -> Path:
    """The bundled reference with every dataset re-declared as `rows` rows, chunked and never written (a tiny file
    that claims e.g. 1e9 rows: HDF5 reads the unwritten rows as the fill value); root num_tokens set when given."""
    shutil.copy(TINY_REF, path)
    with h5py.File(path, "r+") as f:
        for group in ("inputs", "stages", "evidence"):
            for name in list(f[group]):
                old = f[group][name]
                shape, dtype, attrs = (rows, *old.shape[1:]), old.dtype, dict(old.attrs)
                del f[group][name]
                new = f[group].create_dataset(name, shape=shape, dtype=dtype, chunks=(min(rows, 1024), *shape[1:]))
                new.attrs.update(attrs)
        if num_tokens is not None:
            f.attrs["num_tokens"] = num_tokens
    return path


_MTP_PROBE = "import sys; from probe.cli import main; main()"


@pytest.mark.parametrize("command", ["inspect", "inputs", "diff-as-reference", "diff-as-candidate"])
def test_a_trace_claiming_1e9_rows_is_refused_at_once(tmp_path, command):
    huge = _claims_rows(tmp_path / "huge.h5", 10**9, num_tokens=10**9)
    args, code = {"inspect": (["inspect", huge], None),
                  "inputs": (["inputs", huge, "--out-dir", tmp_path / "in"], None),
                  "diff-as-reference": (["diff", huge, TINY_REF], _MTP_PROBE),
                  "diff-as-candidate": (["diff", TINY_REF, huge], _MTP_PROBE)}[command]
    before = digests([huge])
    result = run_program(args, timeout=60, code=code)  # before: 238 GiB allocated, or read for ever
    assert_exit_2(result, "claims [1000000000, 64] float32 (238.4 GiB), but the file stores 0 bytes", tmp_path)
    assert digests([huge]) == before and not (tmp_path / "in").exists()


def test_a_candidate_whose_datasets_contradict_its_num_tokens_is_invalid(tmp_path):
    for rows, num_tokens in ((10**9, None), (8, 5), (8, 9)):  # datasets vs the root attribute (the reference's T=8)
        cand = _claims_rows(tmp_path / f"cand-{rows}-{num_tokens}.h5", rows, num_tokens) if rows != 8 else \
            shutil.copy(TINY_REF, tmp_path / f"cand-{num_tokens}.h5")
        if num_tokens is not None and rows == 8:
            with h5py.File(cand, "r+") as f:
                f.attrs["num_tokens"] = num_tokens
        result = run_program(["diff", TINY_REF, cand], timeout=60, code=_MTP_PROBE)
        assert_exit_2(result, "the file contradicts itself", tmp_path)


def test_twin_a_consistent_candidate_still_passes():
    assert run_cli(probe.cli.cli, ["diff", TINY_REF, TINY_REF]).exit_code == 0


def test_an_unwritten_stage_of_a_small_candidate_is_still_reported_row_by_row(tmp_path):
    """Twin of the size check: below CLAIM_SLACK a never-written stage is the diff's own finding (which rows)."""
    cand = tmp_path / "cand.h5"
    shutil.copy(TINY_REF, cand)
    with h5py.File(cand, "r+") as f:
        attrs = dict(f["stages/mlp"].attrs)
        del f["stages/mlp"]
        f.create_dataset("stages/mlp", shape=(8, 64), dtype="f4", chunks=(4, 64)).attrs.update(attrs)
    result = run_cli(probe.cli.cli, ["diff", TINY_REF, cand])
    assert result.exit_code == 2 and "stage mlp: 8 row(s)" in result.output, result.output


def test_a_hidden_claiming_1e9_rows_is_refused_before_it_is_read(tmp_path):
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f.create_dataset("h", shape=(10**9, 64), dtype="f4", chunks=(1024, 64))
    header = np.lib.format.header_data_from_array_1_0(np.zeros((4, 64), np.float32)) | {"shape": (10**9, 64)}
    with open(tmp_path / "h.npy", "wb") as f:  # a .npy whose header claims 1e9 rows, holding 4
        np.lib.format.write_array_header_1_0(f, header)
        f.write(np.zeros((4, 64), np.float32).tobytes())
    for spec, pattern in ((f"{tmp_path / 'h.h5'}:/h", "has 1000000000 rows but 4 token ids"),
                          (tmp_path / "h.npy", "header claims [1000000000, 64] float32")):
        result = run_program(["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", TOKENS, "--hidden", spec],
                             timeout=60)
        assert_exit_2(result, pattern, tmp_path)
    with open(tmp_path / "t.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, header | {"shape": (10**9,), "descr": "<i8"})
    result = run_program(["export", TINY, "--out", tmp_path / "ref.h5", "--tokens-file", tmp_path / "t.npy",
                          "--hidden-seed", "0"], timeout=60)
    assert_exit_2(result, "header claims [1000000000] int64", tmp_path)


def test_twin_a_hidden_of_the_right_rows_exports(tmp_path):
    np.save(tmp_path / "h.npy", np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32))
    result = run_cli(oracle.cli.cli, ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                      "--hidden", tmp_path / "h.npy", "-q"])
    assert result.exit_code == 0, result.output


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_fifo_where_a_file_belongs_is_refused_not_waited_on(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    (ckpt / "config.json").unlink()
    _fifo(ckpt / "config.json")
    profile = _fifo(tmp_path / "profile.json")
    cases = [
        (["export", TINY, "--out", tmp_path / "a.h5", "--tokens-file", _fifo(tmp_path / "t.txt"), "--hidden-seed",
          "0"], None, "tokens file"),
        (["export", ckpt, "--out", tmp_path / "b.h5", "--tokens", TOKENS, "--hidden-seed", "0"], None, "config.json"),
        (["diff", TINY_REF, TINY_REF, "--profile", f"{profile}:float32"], _MTP_PROBE, "profile"),
        (["weights", TINY, _fifo(tmp_path / "dump.safetensors")], _MTP_PROBE, "weights dump"),
    ]
    for args, code, what in cases:
        result = run_program(args, timeout=30, code=code)  # before: blocked for ever opening the FIFO
        assert_exit_2(result, "FIFO", tmp_path)
        assert what in result.stderr, result.stderr


def test_accept_refuses_a_sequence_whose_bridge_pass_cannot_fit(tmp_path, monkeypatch):
    import oracle.limits

    monkeypatch.setattr(oracle.limits, "available_memory", lambda: 2 << 30)
    tokens = ",".join(str(i % 500) for i in range(20000))
    result = run_cli(oracle.cli.cli, ["accept", TINY, "--tokens", tokens, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 2 and "accept over N=20000 tokens needs about" in result.output, result.output
    fits = int(re.search(r"Measure at most (\d+) tokens", result.output).group(1))
    cfg = Checkpoint(TINY).config
    assert oracle.limits.accept_bytes(cfg, fits, 4) <= 2 << 30 < oracle.limits.accept_bytes(cfg, fits + 1, 4)
    twin = run_cli(oracle.cli.cli, ["accept", TINY, "--tokens", ",".join(str(i) for i in range(40)), "--hidden-seed",
                                    "0", "-q"])
    assert twin.exit_code == 0, twin.output


def test_accept_estimate_is_quadratic_and_on_the_high_side():
    """Measured on this fixture (/usr/bin/time -v, peak RSS less the 0.39 GB of a bare accept at N=1000): N=6000
    used 1.28 GB, the estimate says 1.75 GiB. A doubled N quadruples it: the bridge pass is N x N."""
    from oracle.limits import accept_bytes

    cfg = Checkpoint(TINY).config
    assert 1.28e9 < accept_bytes(cfg, 6000, 4) < 2.5e9
    assert 3.8 < accept_bytes(cfg, 100_000, 4) / accept_bytes(cfg, 50_000, 4) < 4.1


def test_run_refuses_a_reference_whose_buffers_cannot_fit(monkeypatch):
    import oracle.limits
    from oracle.limits import check_run_memory
    from oracle.errors import InputError

    with pytest.raises(InputError, match=r"T=100000 steps needs about .* at most \d+ steps"):
        check_run_memory(100_000, 11 * 5120, available=8 << 30)
    check_run_memory(1000, 11 * 5120, available=8 << 30)  # twin: fits
    cfg = Checkpoint(TINY).config
    with pytest.raises(InputError, match=r"\[4, T, T\] attention scores"):
        check_run_memory(100_000, 1000, available=64 << 30, batched=cfg)
    monkeypatch.setattr(oracle.limits, "available_memory", lambda: 1 << 10)
    result = run_cli(probe.cli.cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", TINY])
    assert result.exit_code == 2 and "running the candidate on T=8 steps needs about" in result.output, result.output
    monkeypatch.undo()
    assert run_cli(probe.cli.cli, ["run", TINY_REF, "--impl", "torch", "--checkpoint", TINY]).exit_code == 0


# --- cause 5: malformed values are exit 2 with a message, never Python's own error -------------------------------

def _config_text(edit) -> str:
    text = (TINY / "config.json").read_text()
    return edit(text)


def _nested(text: str, depth: int) -> str:
    """config.json with a key "x" holding `depth` nested arrays."""
    return json.dumps(json.loads(text) | {"x": "X"}).replace('"X"', "[" * depth + "]" * depth)


_BAD_JSON = {  # config.json text -> the message
    "int of 5000 digits": (lambda t: t.replace('"hidden_size": 64', '"hidden_size": ' + "9" * 5000, 1),
                           "an integer of 5000 digits"),
    "1e400": (lambda t: t.replace('"hidden_size": 64', '"hidden_size": 1e400', 1), "the number 1e400 is beyond"),
    "NaN": (lambda t: t.replace('"hidden_size": 64', '"hidden_size": NaN', 1), "NaN is not a JSON number"),
    "nested 100": (lambda t: _nested(t, 100), "nests 65 levels deep"),
    "nested 100000": (lambda t: _nested(t, 100000), "nests deeper than 64 levels"),
    "repeated key": (lambda t: t.replace('"hidden_size": 64', '"hidden_size": 64, "hidden_size": 32', 1),
                     "'hidden_size' is given twice"),
}


@pytest.mark.parametrize("case", sorted(_BAD_JSON))
def test_malformed_json_in_config_is_exit_2(tmp_path, case):
    edit, pattern = _BAD_JSON[case]
    ckpt = checkpoint_copy(tmp_path)
    text = _config_text(edit)
    assert text != (TINY / "config.json").read_text(), "the edit did not apply"
    (ckpt / "config.json").write_text(text)
    assert_refused(oracle.cli.cli, ["export", ckpt, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                    "--hidden-seed", "0"], pattern, [ckpt], tmp_path)


def test_malformed_numbers_in_a_profile_or_an_index_are_exit_2(tmp_path):
    result = run_cli(oracle.cli.cli, ["noise", TINY, "--out", tmp_path / "p.json", "--tokens", TOKENS,
                                      "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "p.json").read_text()
    number = re.search(r"\d\.\d+e-\d+", text).group(0)
    for bad, pattern in (("1e400", "1e400 is beyond float range"), ("9" * 5000, "an integer of 5000 digits")):
        (tmp_path / "bad.json").write_text(text.replace(number, bad, 1))
        assert_refused(probe.cli.cli, ["diff", TINY_REF, TINY_REF, "--profile", f"{tmp_path / 'bad.json'}:float32"],
                       pattern, [tmp_path / "bad.json"], tmp_path)
    twin = run_cli(probe.cli.cli, ["diff", TINY_REF, TINY_REF, "--profile", f"{tmp_path / 'p.json'}:float32"])
    assert twin.exit_code == 0, twin.output
    sharded = checkpoint_copy(tmp_path, FIXTURES / "qwen3_5_tiny_sharded", "sharded")
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("{", '{"n": ' + "9" * 5000 + ",", 1))
    assert_refused(oracle.cli.cli, ["export", sharded, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                    "--hidden-seed", "0"], "an integer of 5000 digits", [sharded], tmp_path)


def _npz_as_npy(path: Path, array: np.ndarray) -> Path:
    np.savez(path.with_suffix(""), a=array)
    os.replace(path.with_suffix(".npz"), path)
    return path


def test_an_npz_saved_as_npy_is_exit_2(tmp_path):
    tokens = _npz_as_npy(tmp_path / "tokens.npy", np.array([17, 42, 3, 255]))
    hidden = _npz_as_npy(tmp_path / "hidden.npy", np.zeros((4, 64), np.float32))
    dump = tmp_path / "dump"
    dump.mkdir()
    _npz_as_npy(dump / "mtp.fc.weight.npy", np.zeros((64, 128), np.float32))
    for cli, args in ((oracle.cli.cli, ["export", TINY, "--out", tmp_path / "a.h5", "--tokens-file", tokens,
                                        "--hidden-seed", "0"]),
                      (oracle.cli.cli, ["export", TINY, "--out", tmp_path / "b.h5", "--tokens", TOKENS,
                                        "--hidden", hidden]),
                      (probe.cli.cli, ["weights", TINY, dump])):
        assert_refused(cli, args, r"is a \.npz archive \(np\.savez\), not a \.npy array", [tokens, hidden, dump],
                       tmp_path)
    np.save(dump / "mtp.fc.weight.npy", Checkpoint(TINY).read("mtp.fc.weight"))  # twin: a real .npy
    result = run_cli(probe.cli.cli, ["weights", TINY, dump])
    assert result.exit_code == 1 and "missing" in result.output and "mtp.fc.weight" not in \
        result.output.split("ok")[0].split("missing")[0], result.output


def test_links_behind_hidden_h5_are_exit_2(tmp_path):
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f["group/real"] = np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)
        f["soft"] = h5py.SoftLink("/group/real")
        f["loop"] = h5py.SoftLink("/loop")
        f["dangling"] = h5py.SoftLink("/nothing")
        f["external"] = h5py.ExternalLink("h.h5", "/group/real")
        f["missing_file"] = h5py.ExternalLink("nowhere.h5", "/x")
        f["via"] = h5py.SoftLink("/group")
    for name, pattern in (("soft", "/soft is a soft link"), ("loop", "/loop is a soft link"),
                          ("dangling", "/dangling is a soft link"), ("external", "/external is an external link"),
                          ("missing_file", "/missing_file is an external link"), ("via/real", "/via is a soft link")):
        assert_refused(oracle.cli.cli, ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                        "--hidden", f"{tmp_path / 'h.h5'}:/{name}"], pattern, [tmp_path / "h.h5"],
                       tmp_path)
    twin = run_cli(oracle.cli.cli, ["export", TINY, "--out", tmp_path / "ref.h5", "--tokens", TOKENS, "--hidden",
                                    f"{tmp_path / 'h.h5'}:/group/real", "-q"])
    assert twin.exit_code == 0, twin.output


gguf = pytest.importorskip("gguf")


def _gguf(path: Path) -> Path:
    from tests.oracle.test_gguf import write_gguf

    return write_gguf(path, TINY, gguf.GGMLQuantizationType.BF16)


def test_gguf_faults_are_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    model = _gguf(folder / "m.gguf")
    export = ["export", model, "--out", tmp_path / "ref.h5", "--tokens", TOKENS, "--hidden-seed", "0"]
    result = run_cli(oracle.cli.cli, export + ["-q"])  # twin: builds the cache, exports
    assert result.exit_code == 0, result.output
    (record,) = (tmp_path / "cache" / "gguf").glob("*/gguf_source.json")
    good = record.read_text()
    for text, pattern in (("{broken", "GGUF cache record .* is not valid JSON"),
                          ('{"format": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
                          ("[]", "is not the record mtp-oracle writes")):
        record.write_text(text)
        assert_refused(oracle.cli.cli, export, pattern + ".*remove it, and it is rebuilt" if "JSON" in pattern
                       else pattern, [model], tmp_path)
    record.write_text(good)
    # HOME unset, no passwd entry: Path.home() raises; MTP_PROBE_CACHE unset
    monkeypatch.delenv("MTP_PROBE_CACHE")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert_refused(oracle.cli.cli, export, "mtp-probe's cache has no folder: MTP_PROBE_CACHE is not set", [model],
                   tmp_path)
    monkeypatch.undo()
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    # a zero-length key (the first, general.architecture, renamed to ""): the header after it still parses
    import struct

    raw = bytearray(model.read_bytes())
    length = struct.unpack_from("<Q", raw, 24)[0]  # magic, version, tensor count, kv count, then the first key
    (tmp_path / "zero_key.gguf").write_bytes(raw[:24] + struct.pack("<Q", 0) + raw[32 + length:])
    assert_refused(oracle.cli.cli, ["export", tmp_path / "zero_key.gguf", "--out", tmp_path / "z.h5", "--tokens",
                                    TOKENS, "--hidden-seed", "0"], "zero_key.gguf: architecture None", [model],
                   tmp_path)
    # neither an output nor an embedding tensor
    from tests.oracle.test_gguf import LLAMA_NAME

    ckpt = Checkpoint(TINY)
    writer = gguf.GGUFWriter(folder / "bare.gguf", "qwen35")
    block = ckpt.raw_config["text_config"]["num_hidden_layers"]
    for name, values in ckpt.read_head(digest=False).tensors.items():
        writer.add_tensor(f"blk.{block}.{LLAMA_NAME[name]}.weight", values)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    bare = tmp_path / "bare"
    bare.mkdir()
    os.replace(folder / "bare.gguf", bare / "bare.gguf")
    shutil.copy(TINY / "config.json", bare / "config.json")
    assert_refused(oracle.cli.cli, ["export", bare / "bare.gguf", "--out", tmp_path / "b.h5", "--tokens", TOKENS,
                                    "--hidden-seed", "0"], "holds neither token_embd.weight nor output.weight",
                   [bare], tmp_path)


def _small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only), or skip: a real ENOSPC from the kernel."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    return path


@pytest.fixture
def full_disk(tmp_path):
    mount = _small_tmpfs(tmp_path / "full", "4k")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_in_the_gguf_cache_is_exit_2_and_keeps_nothing(tmp_path, monkeypatch, full_disk):
    model = _gguf(tmp_path / "m.gguf")
    monkeypatch.setenv("MTP_PROBE_CACHE", str(full_disk))
    assert_refused(oracle.cli.cli, ["export", model, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                    "--hidden-seed", "0"], "no space left on .* while dequantizing m.gguf", [model],
                   tmp_path)
    assert not [p for p in full_disk.rglob("*") if p.is_file()]


def test_a_string_initializer_range_and_a_zero_width_stage_are_exit_2(tmp_path):
    ckpt = checkpoint_copy(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["initializer_range"] = "0.02"
    (ckpt / "config.json").write_text(json.dumps(raw))
    dump = tmp_path / "dump"
    dump.mkdir()
    np.save(dump / "mtp.fc.weight.npy", Checkpoint(TINY).read("mtp.fc.weight"))
    assert_refused(probe.cli.cli, ["weights", ckpt, dump], "initializer_range is '0.02'; it is the std", [ckpt, dump],
                   tmp_path)
    trace = tmp_path / "w0.h5"
    shutil.copy(TINY_REF, trace)
    with h5py.File(trace, "r+") as f:
        attrs = dict(f["stages/e"].attrs)
        del f["stages/e"]
        f.create_dataset("stages/e", shape=(8, 0), dtype="f4").attrs.update(attrs)
    assert_refused(oracle.cli.cli, ["inspect", trace], r"/stages/e has shape \[8, 0\]: rows of no values", [trace],
                   tmp_path)
    assert run_cli(oracle.cli.cli, ["inspect", TINY_REF]).exit_code == 0  # twin


def test_selftest_given_a_moe_reference_is_exit_2(tmp_path):
    ref = tmp_path / "moe.h5"
    assert run_cli(oracle.cli.cli, ["export", MOE, "--out", ref, "--tokens", TOKENS, "--hidden-seed", "0",
                                    "-q"]).exit_code == 0
    assert_refused(probe.cli.cli, ["selftest", "--reference", ref, "--checkpoint", MOE, "-q"],
                   "a qwen3_5_moe trace; the selftest's candidates implement the qwen3_5 head", [ref], tmp_path)


# --- cause 7: an output never changes what an input means ------------------------------------------------------

def test_no_output_is_created_in_a_checkpoint_folder_under_a_name_its_reader_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    model = _gguf(folder / "m.gguf")
    from oracle.gguf_source import gguf_file

    for name in ("model.safetensors", "x.safetensors", "config.json", "model.safetensors.index.json", "y.gguf"):
        for cli, args in ((oracle.cli.cli, ["export", folder, "--out", folder / name, "--tokens", TOKENS,
                                            "--hidden-seed", "0"]),
                          (oracle.cli.cli, ["accept", model, "--tokens", ",".join(map(str, range(12))),
                                            "--hidden-seed", "0", "--json", folder / name])):
            assert_refused(cli, args, "would be written into the folder of the checkpoint|is the config.json beside "
                           "the GGUF", [folder], tmp_path)
            assert gguf_file(folder) == folder / "m.gguf", "the folder no longer reads as the GGUF"
    ckpt = checkpoint_copy(tmp_path)
    assert_refused(probe.cli.cli, ["weights", ckpt, ckpt / "model.safetensors", "--json",
                                   ckpt / "model.safetensors.index.json"], "would be written into the folder", [ckpt],
                   tmp_path)
    # twin: a trace beside the GGUF is written, and the folder still reads as the GGUF
    result = run_cli(oracle.cli.cli, ["export", folder, "--out", folder / "ref.h5", "--tokens", TOKENS,
                                      "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0 and gguf_file(folder) == folder / "m.gguf", result.output


def test_the_gguf_cache_is_never_the_gguf_folder_itself(tmp_path, monkeypatch):
    folder = tmp_path / "gguf"
    folder.mkdir()
    model = _gguf(folder / "m.gguf")
    monkeypatch.setenv("MTP_PROBE_CACHE", str(tmp_path))  # the cache root would be tmp_path/gguf: the GGUF's folder
    assert_refused(oracle.cli.cli, ["export", model, "--out", tmp_path / "ref.h5", "--tokens", TOKENS,
                                    "--hidden-seed", "0"], "the GGUF cache .* is the folder of", [folder], tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["m.gguf"]


# --- cause 8: the smaller points -------------------------------------------------------------------------------

def test_assert_trace_close_refuses_ragged_arrays_and_malformed_stage_tol():
    from oracle.errors import MtpError
    from probe.testing import assert_trace_close

    good = {"fc": np.zeros((8, 64), np.float32)}
    for kwargs in ({"stage_tol": {"fc": 1e-3}}, {"stage_tol": 1e-3}, {"stage_tol": {"fc": (1e-3,)}},
                   {"stage_tol": {"fc": ("a", "b")}}, {"stage_tol": {"fc": "1e-3"}}, {"rtol": "1e-3", "atol": 1e-5}):
        with pytest.raises(MtpError, match="assert_trace_close: (stage_tol|rtol)"):
            assert_trace_close(TINY_REF, good, **kwargs)
    for ragged in ([[0.0] * 64] * 7 + [[0.0] * 3], [np.zeros(64, np.float32)] * 7 + [np.zeros(3, np.float32)]):
        with pytest.raises(MtpError, match="stage fc is not a rectangular array|holds Python objects"):
            assert_trace_close(TINY_REF, {"fc": ragged})
    with read_reference_stages() as stages:  # twin: the reference's own rows, with a well-formed stage_tol
        assert assert_trace_close(TINY_REF, stages, stage_tol={"fc": (1e-4, 1e-5)}).verdict.name == "pass"


class read_reference_stages:
    def __enter__(self):
        with h5py.File(TINY_REF) as f:
            return {name: f["stages"][name][()] for name in f["stages"]}

    def __exit__(self, *exc):
        return False


def test_a_full_disk_in_mtp_oracle_inputs_says_no_space_left_and_writes_nothing(tmp_path, full_disk):
    out = full_disk / "inputs"
    assert_refused(oracle.cli.cli, ["inputs", TINY_REF, "--out-dir", out], "no space left on", [TINY_REF], tmp_path)
    assert not [p for p in full_disk.rglob("*") if p.is_file()], "a partial set of input files was left"


def test_twin_mtp_oracle_inputs_on_a_disk_with_room(tmp_path):
    roomy = _small_tmpfs(tmp_path / "roomy", "1m")
    try:
        result = run_cli(oracle.cli.cli, ["inputs", TINY_REF, "--out-dir", roomy / "inputs"])
        assert result.exit_code == 0, result.output
        assert (roomy / "inputs" / "hidden.bin").stat().st_size == 8 * 64 * 4
    finally:
        subprocess.run(["umount", str(roomy)], capture_output=True)
