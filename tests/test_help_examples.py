"""Every command's --help ends with an Examples section whose lines name real commands and real options, and
`run --help` states the python:MODULE:FACTORY contract and where the C header is."""

import re
import shlex

import click
import pytest

from oracle.cli import cli as oracle_cli
from probe.cli import cli as probe_cli
from tests.helpers import ROOT, run_cli

GROUPS = {"mtp-oracle": oracle_cli, "mtp-probe": probe_cli}
COMMANDS = [(prog, name) for prog, group in GROUPS.items() for name in sorted(group.commands)]


def example_problems(help_text: str) -> list[str]:
    """What is wrong with a help text's examples: no Examples section, fewer than two mtp-* lines, or a line
    naming a command or option that does not exist."""
    if "Examples:" not in help_text:
        return ["no Examples section"]
    section = help_text.split("Examples:", 1)[1]
    calls = re.findall(r"\b(mtp-oracle|mtp-probe) ([^|&;\n]+)", section)
    problems = [] if len(calls) >= 2 else [f"{len(calls)} example line(s), want 2 or 3"]
    for prog, rest in calls:
        words = shlex.split(rest)
        command = GROUPS[prog].commands.get(words[0])
        if command is None:
            problems.append(f"{prog} {words[0]}: no such command")
            continue
        known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
        problems += [f"{prog} {words[0]} {w}: no such option" for w in words[1:]
                     if w.startswith("-") and w.split("=")[0] not in known]
    return problems


@pytest.mark.parametrize("prog, name", COMMANDS)
def test_every_command_help_has_examples_of_real_commands(prog, name):
    result = run_cli(GROUPS[prog], [name, "--help"])
    assert result.exit_code == 0, result.output
    assert example_problems(result.output) == []


def test_the_check_fails_on_help_without_examples_or_with_a_made_up_option():
    bare = click.Command("bare", params=[click.Option(["--out"])], help="Does a thing.")
    assert example_problems(bare.get_help(click.Context(bare))) == ["no Examples section"]
    made_up = "Examples:\n  mtp-probe diff ref.h5 c.h5 --no-such-flag\n  mtp-oracle frobnicate ref.h5\n"
    assert example_problems(made_up) == ["mtp-probe diff --no-such-flag: no such option",
                                         "mtp-oracle frobnicate: no such command"]


def test_run_help_explains_the_python_contract_and_the_c_header():
    text = run_cli(probe_cli, ["run", "--help"]).output
    assert "python:MODULE:FACTORY" in text and "FACTORY(config, weights) -> impl" in text
    assert "impl.step(pos, embed_row, hidden, out," in text and "fixtures/candidates/numpy_step.py" in text
    assert "fixtures/candidates/mtp_probe.h" in text and (ROOT / "fixtures/candidates/mtp_probe.h").is_file()


def test_a_help_example_runs_as_written(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = run_cli(oracle_cli, ["inspect", "fixtures/qwen3_5_tiny_ref.h5"])
    assert result.exit_code == 0, result.output
