"""fixtures/candidates/mtp_trace_writer.h: an engine that dumps through it produces a raw directory the probe passes
(trace_writer_example.c runs mtp_step.c's head on the reference's inputs), and a row it never writes is caught, by
the writer and by the probe."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle.cli import cli as oracle_cli
from oracle.stages import STAGES
from probe.cli import cli as probe_cli
from probe.poison import POISON_BITS
from tests.helpers import FIXTURES, TINY, TINY_REF, run_cli

CANDIDATES = FIXTURES / "candidates"
HEADER = CANDIDATES / "mtp_trace_writer.h"
CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CANDIDATES}"]


def _gcc(sources, out, tmp):
    proc = subprocess.run(["gcc", *CFLAGS, *map(str, sources), "-o", str(out), "-lm"], capture_output=True,
                          text=True, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def example(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace-writer")
    return _gcc([CANDIDATES / "trace_writer_example.c", CANDIDATES / "mtp_step.c"], tmp / "trace_writer_example", tmp)


@pytest.fixture(scope="session")
def engine_files(tmp_path_factory):
    """The example engine's weights (config.txt, weights.bin) and the reference's inputs (mtp-oracle inputs)."""
    tmp = tmp_path_factory.mktemp("engine-files")
    proc = subprocess.run([sys.executable, CANDIDATES / "trace_writer_weights.py", TINY, tmp], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    result = run_cli(oracle_cli, ["inputs", TINY_REF, "--out-dir", tmp / "inputs"])
    assert result.exit_code == 0, result.output
    return tmp, tmp / "inputs"


def test_header_stage_list_is_the_registry():
    text = HEADER.read_text()
    macro = re.search(r"#define MTP_TW_STAGES\(X\)\s*\\\s*\n(.*?)\n", text).group(1)
    listed = re.findall(r"X\((\w+), (\d)\)", macro)
    assert [(name, int(mult)) for name, mult in listed] == [(s.name, s.width(1)) for s in STAGES]
    assert f"0x{POISON_BITS:08X}u" in text


def test_example_engine_dump_passes_the_probe(example, engine_files, tmp_path):
    weights, inputs = engine_files
    proc = subprocess.run([example, weights, inputs, tmp_path / "dump"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == sorted(
        [f"{s.name}.bin" for s in STAGES] + ["hidden.bin", "inputs.json"])
    result = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "dump"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("PASSED | 11 stages x 8 tokens within tolerance")
    assert "identical to the reference: token_ids, positions, hidden" in result.output


def test_twin_a_skipped_row_is_reported_by_the_writer_and_invalid_in_the_probe(example, engine_files, tmp_path):
    weights, inputs = engine_files
    proc = subprocess.run([example, weights, inputs, tmp_path / "dump", "--skip", "attn:3"], capture_output=True,
                          text=True)
    assert proc.returncode == 1
    assert "row never written: attn row 3 (left as poison 0x7FDEAD00)" in proc.stderr
    result = run_cli(probe_cli, ["diff", TINY_REF, tmp_path / "dump"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("INVALID | unwritten rows: attn at token(s) 3 |")


DRIVER = r"""
#include "mtp_trace_writer.h"
#define SHOW(call) printf("%s -> %d\n", #call, (call))
int main(int argc, char **argv) {
    (void)argc;
    float row[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    mtp_trace_writer w;
    SHOW(mtp_tw_open(&w, argv[1], 3, 4));
    SHOW(mtp_tw_capture(&w, "attn"));
    SHOW(mtp_tw_capture(&w, "fc_in"));
    SHOW(mtp_tw_row(&w, "attn", 0, row));
    SHOW(mtp_tw_row(&w, "attn", 2, row + 4));
    SHOW(mtp_tw_row(&w, "fc_in", 1, row));
    SHOW(mtp_tw_input(&w, 0, 17, 5));
    SHOW(mtp_tw_input(&w, 1, 42, 6));
    SHOW(mtp_tw_row(&w, "atn", 1, row));
    printf("error: %s\n", mtp_tw_error(&w));
    SHOW(mtp_tw_row(&w, "attn", 3, row));
    SHOW(mtp_tw_row(&w, "out", 0, row));
    SHOW(mtp_tw_capture(&w, "attn"));
    SHOW(mtp_tw_close(&w));
    printf("error: %s\n", mtp_tw_error(&w));
    return 0;
}
"""


def test_writer_poisons_what_it_never_wrote_and_reports_misuse(tmp_path):
    (tmp_path / "driver.c").write_text(DRIVER)
    driver = _gcc([tmp_path / "driver.c"], tmp_path / "driver", tmp_path)
    dump = tmp_path / "dump"
    dump.mkdir()
    for stale in ("mh.bin", "hidden.bin", "inputs.json"):  # left by an earlier dump: must not be read as this one
        (dump / stale).write_text("stale")
    proc = subprocess.run([driver, dump], capture_output=True, text=True, check=True)
    codes = dict(re.findall(r"^(mtp_tw_\w+\(.*?\)) -> (\d+)$", proc.stdout, re.M))
    assert codes['mtp_tw_open(&w, argv[1], 3, 4)'] == "0"
    assert codes['mtp_tw_row(&w, "atn", 1, row)'] == "1"  # unknown stage: MTP_TW_ERR_ARG
    assert codes['mtp_tw_row(&w, "attn", 3, row)'] == "1"  # row outside 0..T-1
    assert codes['mtp_tw_row(&w, "out", 0, row)'] == "3"  # a stage not captured: MTP_TW_ERR_STATE
    assert codes['mtp_tw_capture(&w, "attn")'] == "3"  # (the second capture; dict keeps the last)
    assert codes["mtp_tw_close(&w)"] == "1"  # the first error of the dump is kept
    assert "error: mtp_trace_writer: unknown stage name (see MTP_TW_STAGES): atn" in proc.stdout

    assert sorted(p.name for p in dump.iterdir()) == ["attn.bin", "fc_in.bin", "inputs.json"]
    attn = np.fromfile(dump / "attn.bin", dtype="<u4").reshape(3, 4)
    assert attn[0].view("<f4").tolist() == [1, 2, 3, 4] and attn[2].view("<f4").tolist() == [5, 6, 7, 8]
    assert (attn[1] == POISON_BITS).all()  # never written: the exact poison bits, little-endian
    fc_in = np.fromfile(dump / "fc_in.bin", dtype="<u4").reshape(3, 8)
    assert fc_in[1].view("<f4").tolist() == list(range(1, 9)) and (fc_in[[0, 2]] == POISON_BITS).all()
    assert json.loads((dump / "inputs.json").read_text()) == {"token_ids": [17, 42, -1], "positions": [5, 6, -1]}


def test_twin_close_reports_missing_rows_and_inputs_when_nothing_else_failed(tmp_path):
    source = DRIVER.replace('    SHOW(mtp_tw_row(&w, "atn", 1, row));\n', "").replace(
        '    SHOW(mtp_tw_row(&w, "attn", 3, row));\n    SHOW(mtp_tw_row(&w, "out", 0, row));\n'
        '    SHOW(mtp_tw_capture(&w, "attn"));\n', "")
    (tmp_path / "driver.c").write_text(source)
    driver = _gcc([tmp_path / "driver.c"], tmp_path / "driver", tmp_path)
    proc = subprocess.run([driver, tmp_path / "dump"], capture_output=True, text=True, check=True)
    assert "mtp_tw_close(&w) -> 4" in proc.stdout  # MTP_TW_ERR_MISSING
    assert "error: mtp_trace_writer: inputs never recorded: row 2 (written as -1)" in proc.stdout


# --- the example's own build and run lines, as written at its top --------------------------------------------

def _header_commands() -> list[str]:
    """The shell lines of trace_writer_example.c's comment under "Build" and "Run:", continuations joined."""
    comment = (CANDIDATES / "trace_writer_example.c").read_text().split("*/", 1)[0]
    lines = [line.removeprefix(" *").strip() for line in comment.splitlines()]
    start, stop = lines.index("Build, from the repository root:") + 1, next(
        i for i, line in enumerate(lines) if line.startswith("WEIGHTS_DIR"))
    commands, pending = [], ""
    for line in lines[start:stop]:
        if not line or line == "Run:":
            continue
        pending += line.split("  #", 1)[0].strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(pending.replace(" [--skip STAGE:T]", ""))
        pending = ""
    return commands


def test_the_examples_own_build_and_run_lines_work_as_written(tmp_path):
    """From a fresh folder (fixtures/ linked in as in the repository root): gcc, the weights script, `mtp-oracle
    inputs`, the engine, `mtp-probe diff` -> PASSED. Nothing but these lines makes the engine's weights folder."""
    commands = _header_commands()
    assert [c.split()[0] for c in commands] == ["gcc", "python", "mtp-oracle", "./trace_writer_example", "mtp-probe"]
    os.symlink(FIXTURES, tmp_path / "fixtures")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        argv = shlex.split(command)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.strip().splitlines()[-1].startswith("PASSED | 11 stages x 8 tokens within tolerance")


def test_twin_the_weights_script_refuses_a_family_the_example_cannot_run(tmp_path):
    proc = subprocess.run([sys.executable, CANDIDATES / "trace_writer_weights.py", FIXTURES / "qwen3_5_moe_tiny",
                           tmp_path / "w"], capture_output=True, text=True)
    assert proc.returncode == 2 and "dense Qwen3.5 head (C ABI v1) only" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "w" / "weights.bin").exists()
# --- chains (issue 24): per-depth writes into d{j}/, rows = bridge positions ---------------------------------------

CHAIN_DRIVER = r"""
#include "mtp_trace_writer.h"
/* Replays a chain reference's rows through the writer in an engine's order: bridge i, then its chain depths.
 * argv: ROWS OUT T D K [SKIP_DEPTH SKIP_ROW]: ROWS/d{j}/<stage>.bin float32 (draft.bin int64), j = 1..K. */
static int read_row(const char *rows, int depth, const char *stage, int64_t r, int64_t width, size_t item, void *out) {
    char path[1200];
    snprintf(path, sizeof path, "%s/d%d/%s.bin", rows, depth, stage);
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    int bad = fseek(f, (long)(r * width * (int64_t)item), SEEK_SET) != 0 || fread(out, item, (size_t)width, f) != (size_t)width;
    fclose(f);
    return bad;
}
int main(int argc, char **argv) {
    if (argc < 6) return 2;
    int64_t T = atoll(argv[3]), D = atoll(argv[4]);
    int K = atoi(argv[5]), skip_depth = argc > 7 ? atoi(argv[6]) : 0, skip_row = argc > 7 ? atoi(argv[7]) : -1;
    mtp_trace_writer w[MTP_TW_MAX_DEPTH + 1];
    if (mtp_tw_open(&w[1], argv[2], T, D) || mtp_tw_capture_all(&w[1]) || mtp_tw_capture(&w[1], "draft")) {
        fprintf(stderr, "%s\n", mtp_tw_error(&w[1]));
        return 1;
    }
    for (int j = 2; j <= K; j++)
        if (mtp_tw_open_depth(&w[j], &w[1], j) || mtp_tw_capture_all(&w[j]) || mtp_tw_capture(&w[j], "draft")) {
            fprintf(stderr, "%s\n", mtp_tw_error(&w[j]));
            return 1;
        }
    float row[4096];
    for (int64_t i = 0; i < T; i++)
        for (int j = 1; j <= K && i <= T - j; j++) {
            if (j == skip_depth && i == skip_row) continue;
            for (int s = 0; s < MTP_TW_NUM_STAGES; s++) {
                int64_t width = mtp_tw_stage_width(s, D);
                if (read_row(argv[1], j, mtp_tw_stage_name(s), i, width, 4, row)) return 3;
                mtp_tw_row(&w[j], mtp_tw_stage_name(s), i, row);
            }
            int64_t token;
            if (read_row(argv[1], j, "draft", i, 1, 8, &token)) return 3;
            mtp_tw_draft_row(&w[j], i, token);
        }
    SHOW_HIDDEN_MISUSE
    int status = 0;
    for (int j = 1; j <= K; j++)
        if (mtp_tw_close(&w[j])) {
            fprintf(stderr, "%s\n", mtp_tw_error(&w[j]));
            status = 1;
        }
    return status;
}
"""


@pytest.fixture(scope="module")
def chain_rows(tmp_path_factory):
    """A chain reference (tests/probe/test_chain_diff.py's construction) and its rows as d{j}/<stage>.bin files."""
    import h5py

    from tests.probe.chain_reference import chain_reference
    from tests.probe.tracekit import load_trace

    tmp = tmp_path_factory.mktemp("chain-writer")
    ref = chain_reference(tmp / "ref.h5", 3)
    inputs, _ = load_trace(ref)
    rows = tmp / "rows"
    with h5py.File(ref) as f:
        for j, group in ((1, f["stages"]), *((j, f[f"chain/d{j}/stages"]) for j in (2, 3))):
            (rows / f"d{j}").mkdir(parents=True)
            for name in group:
                data = group[name][()]
                data.astype("<i8" if data.dtype.kind in "iu" else "<f4").tofile(rows / f"d{j}" / f"{name}.bin")
    return ref, rows, inputs.num_tokens, inputs.hidden_size


def _chain_driver(tmp_path, misuse: bool = False):
    text = CHAIN_DRIVER.replace("SHOW_HIDDEN_MISUSE", 'if (mtp_tw_hidden_row(&w[2], 0, row)) '
                                                      'fprintf(stderr, "%s\\n", mtp_tw_error(&w[2]));'
                                if misuse else "")
    (tmp_path / "chain_driver.c").write_text(text)
    return _gcc([tmp_path / "chain_driver.c"], tmp_path / "chain_driver", tmp_path)


def test_per_depth_writes_pass_the_probe_and_stale_depths_are_removed(chain_rows, tmp_path):
    ref, rows, total, hidden = chain_rows
    driver = _chain_driver(tmp_path)
    dump = tmp_path / "dump"
    (dump / "d5").mkdir(parents=True)
    (dump / "d5" / "out.bin").write_bytes(b"stale")  # an earlier dump's depth: must not be read as this one
    proc = subprocess.run([driver, rows, dump, str(total), str(hidden), "3"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == ["d2", "d3"]
    result = run_cli(probe_cli, ["diff", ref, dump])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("PASSED | 12 stages x 10 tokens within tolerance at "
                                                             "depths 1-3")


def test_twin_a_depth_row_never_written_is_caught_by_writer_and_probe(chain_rows, tmp_path):
    ref, rows, total, hidden = chain_rows
    driver = _chain_driver(tmp_path, misuse=True)
    dump = tmp_path / "dump"
    proc = subprocess.run([driver, rows, dump, str(total), str(hidden), "3", "3", "4"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "a chain depth records no hidden" in proc.stderr
    assert "row never written: d3/e row 4 (left as poison 0x7FDEAD00)" in proc.stderr
    result = run_cli(probe_cli, ["diff", ref, dump])
    assert result.exit_code == 2, result.output
    assert "INVALID | depth 3: unwritten rows: e at token(s) 4, h at token(s) 4" in result.output
