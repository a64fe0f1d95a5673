"""Interrupting the CLIs at many points (tests/test_signals.py; `python -m tests.signal_trials` sweeps more).

A trial runs one command as the real program in a fresh folder whose outputs already hold a previous result, with a
private TMPDIR, sends SIGINT or SIGTERM `delay` seconds after the program started (its first instruction, once the
interpreter is up), and checks what an interrupt must leave:
the exit status 128 + signal (or the command's own status, when it had ended before the signal), no traceback, the
previous outputs byte for byte unless the command ended by itself, nothing beside them, nothing in TMPDIR, and no
process of the command's left running."""

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF

TOKENS = "17,42,3,255,100,7,511,64"
PREVIOUS = b"previous output: must survive an interrupt\n"
# torch's own compile cache, $TMPDIR/torchinductor_<user>: made on every run that loads torch (interrupted or not),
# and kept on purpose (a cache), so not a leftover of ours
TORCH_CACHE = "torchinductor_"


@dataclass
class Command:
    """`args` run in a folder holding `outputs` (each pre-filled with PREVIOUS); {dir} in an arg is that folder."""

    name: str
    program: str  # "oracle" or "probe"
    args: list[str]
    outputs: list[str]
    env: dict = field(default_factory=dict)

    def argv(self, folder: Path) -> list[str]:
        main = f"from {self.program}.program import {self.program}_main; {self.program}_main()"  # the entry point
        return [sys.executable, "-c", main, *(a.format(dir=folder) for a in self.args)]


def commands(library: Path | None = None) -> dict[str, Command]:
    """The commands the trials interrupt; `library`: a built C candidate for `run` (forking, for the group kill)."""
    tiny, ref = str(TINY), str(TINY_REF)
    table = [
        Command("export", "oracle", ["export", tiny, "--tokens", TOKENS, "--hidden-seed", "0", "--out", "{dir}/ref.h5"],
                ["ref.h5"]),
        Command("accept", "oracle", ["accept", tiny, "--tokens", ",".join([TOKENS] * 3), "--hidden-seed", "0", "--json",
                                     "{dir}/acc.json", "--plot", "{dir}/acc.png", "-q"], ["acc.json", "acc.png"]),
        Command("inputs", "oracle", ["inputs", ref, "--out-dir", "{dir}"], ["inputs.json", "hidden.bin", "embed.bin"]),
        Command("noise", "oracle", ["noise", tiny, "--tokens", TOKENS, "--hidden-seed", "0", "--out",
                                    "{dir}/noise.json"], ["noise.json"]),
        Command("diff", "probe", ["diff", ref, ref, "--html", "{dir}/r.html", "--json", "{dir}/r.json", "--plot",
                                  "{dir}/r.png"], ["r.html", "r.json", "r.png"]),
        Command("selftest", "probe", ["selftest", "-q"], []),
        Command("run_python", "probe", ["run", ref, "--impl", "python:numpy_step:make_head", "--checkpoint", tiny,
                                        "--out", "{dir}/cand.h5", "--json", "{dir}/r.json", "--html", "{dir}/r.html"],
                ["cand.h5", "r.json", "r.html"], {"PYTHONPATH": f"{ROOT}:{FIXTURES / 'candidates'}"}),
    ]
    if library is not None:
        table.append(Command("run_c", "probe", ["run", ref, "--impl", f"c:{library}", "--checkpoint", tiny, "--out",
                                                "{dir}/cand.h5", "--json", "{dir}/r.json"], ["cand.h5", "r.json"]))
    return {c.name: c for c in table}


FORK_PIDFILE = "MTP_TEST_FORK_PIDFILE"


def build_forking_library(out_dir: Path) -> Path:
    """fixtures/candidates/mtp_step.c whose mtp_create forks a child that sleeps for a minute (an engine's helper
    process), its pid appended to $MTP_TEST_FORK_PIDFILE."""
    from probe.adapters.cabi import build_library

    source = out_dir / "forking_step.c"
    original = (FIXTURES / "candidates" / "mtp_step.c").read_text()
    source.write_text("#define _POSIX_C_SOURCE 200809L\n#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
                      + original.replace("int mtp_create(", "static int real_create(", 1) + """
int mtp_create(const mtp_config *c, const mtp_weights *w, void **ctx) {
    pid_t child = fork();
    if (child == 0) { sleep(60); _exit(0); }
    const char *path = getenv("MTP_TEST_FORK_PIDFILE");
    if (path) { FILE *f = fopen(path, "a"); if (f) { fprintf(f, "%d\\n", (int)child); fclose(f); } }
    return real_create(c, w, ctx);
}
""")
    return build_library(source, out_dir)


@dataclass
class Trial:
    command: str
    signum: int
    delay: float
    status: int
    problems: list[str]
    elapsed: float = 0.0  # from the program's first instruction to its end

    @property
    def interrupted(self) -> bool:
        return self.status == 128 + self.signum


def run_trial(command: Command, signum: int, delay: float, base: Path, marker: str | None = None) -> Trial:
    """One trial in a fresh folder under `base`. `marker`: an environment variable a forking candidate writes its
    child's pid into (checked: that child must not outlive the command)."""
    folder, tmpdir = base / "out", base / "tmp"
    shutil.rmtree(base, ignore_errors=True)
    folder.mkdir(parents=True)
    tmpdir.mkdir()
    for name in command.outputs:
        (folder / name).write_bytes(PREVIOUS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **command.env, "TMPDIR": str(tmpdir)}
    pidfile = base / "child.pid"
    if marker:
        env[marker] = str(pidfile)
    proc = subprocess.Popen(command.argv(folder), cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    _wait_for_the_guard(proc.pid)
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=delay)  # ended before the signal: a trial of its normal end
    except subprocess.TimeoutExpired:
        proc.send_signal(signum)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return Trial(command.name, signum, delay, proc.returncode, ["did not end within 120 s of the signal"])
    elapsed = time.monotonic() - started
    problems = _problems(command, proc.returncode, signum, folder, tmpdir, err.decode(errors="replace"))
    problems += _survivors(proc.pid, pidfile)
    return Trial(command.name, signum, delay, proc.returncode, problems, elapsed)


def _wait_for_the_guard(pid: int, limit: float = 30.0) -> None:
    """Until the program catches SIGTERM (oracle/program.py guard_start, its first instruction): before that the
    interpreter is still starting, with Python's own defaults, which no program can change."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return  # ended already
        caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.005)


def _problems(command: Command, status: int, signum: int, folder: Path, tmpdir: Path, stderr: str) -> list[str]:
    problems = []
    if status not in (128 + signum, 0, 1, 3):
        problems.append(f"exit status {status}: {stderr.strip()[-400:]}")
    if "Traceback" in stderr:
        problems.append(f"a traceback: {stderr.strip()[-600:]}")
    left = sorted(p.name for p in folder.iterdir() if p.name not in command.outputs)
    if left:
        problems.append(f"left beside the outputs: {left}")
    left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith(TORCH_CACHE))
    if left:
        problems.append(f"left in TMPDIR: {left}")
    if status == 128 + signum:
        changed = [n for n in command.outputs if (folder / n).read_bytes() != PREVIOUS]
        if changed:
            problems.append(f"interrupted, yet the previous outputs changed: {changed}")
    return problems


def _survivors(pgid: int, pidfile: Path) -> list[str]:
    """Processes of the command still running once it has ended: its own group, and a forked child's pid."""
    time.sleep(0.2)
    alive = []
    members = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _in_group(int(p.name), pgid)]
    if any(_running(pid) for pid in members):
        alive.append(f"process group {pgid} ({len(members)} processes)")
        os.killpg(pgid, signal.SIGKILL)
    if pidfile.is_file():
        for text in pidfile.read_text().split():
            if text.isdigit() and _running(int(text)):
                alive.append(f"forked child {text}")
                os.kill(int(text), signal.SIGKILL)
    return [f"still running after the command ended: {', '.join(alive)}"] if alive else []


def _in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits to be reaped by init, which may take its time)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def main(argv: list[str]) -> int:
    """python -m tests.signal_trials [COMMAND ...]: sweep SIGINT and SIGTERM over 0.3..8 s; print each problem."""
    import tempfile

    delays = [float(d) for d in os.environ.get("MTP_SIGNAL_DELAYS", "").split(",") if d] or [
        0.05, 0.3, 0.6, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.5, 8.0]
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        table = commands(build_forking_library(Path(tmp)))
        for name in argv or list(table):
            for signum in (signal.SIGINT, signal.SIGTERM):
                for delay in delays:
                    trial = run_trial(table[name], signum, delay, Path(tmp) / "trial",
                                      FORK_PIDFILE if name == "run_c" else None)
                    tag = "interrupted" if trial.interrupted else f"ended {trial.status}"
                    print(f"{name} {signal.Signals(signum).name} {delay:.1f}s: {tag} "
                          f"{'; '.join(trial.problems) or 'ok'}", flush=True)
                    bad += bool(trial.problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
