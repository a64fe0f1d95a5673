"""The README's ```python snippets run as written (in a temporary directory where `fixtures/` is the repository's).
The pytest example of the probe.testing section is a test file, run as written by tests/probe/test_testing.py."""

import os
import re

import pytest

from tests.helpers import ROOT

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def library_snippets() -> list[str]:
    return [b for b in readme_blocks() if "def test_" not in b]  # test files run under pytest, not exec


def test_the_readme_has_library_snippets_and_the_pytest_example_is_run_elsewhere():
    assert len(library_snippets()) >= 2
    examples = [b for b in readme_blocks() if "def test_" in b]
    assert examples and "README" in (ROOT / "tests/probe/test_testing.py").read_text()


@pytest.mark.parametrize("index", range(len(library_snippets())))
def test_readme_snippet_runs_as_written(index, tmp_path, monkeypatch, capsys):
    os.symlink(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    code = library_snippets()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme_snippet"})


def test_a_snippet_with_an_undefined_name_would_fail(tmp_path, monkeypatch):
    """The twin: what the accept snippet did before it defined `tokens`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NameError, match="tokens"):
        exec("from oracle.accept import measure_acceptance\nmeasure_acceptance('x', tokens, None)", {})
