"""Which way imports point: probe never pulls in transformers; the checkpoint/trace layer needs neither
transformers nor torch; oracle never imports probe."""

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _modules_after_import(statement: str) -> set[str]:
    code = f"{statement}; import sys; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_checkpoint_trace_and_stages_import_neither_torch_nor_transformers():
    loaded = _modules_after_import("import oracle.checkpoint, oracle.trace, oracle.stages, oracle.errors")
    assert "transformers" not in loaded and "torch" not in loaded


@pytest.mark.parametrize("module", ["probe.cli"])
def test_probe_does_not_import_transformers(module):
    if not (ROOT / "probe" / "cli.py").exists():
        pytest.fail("probe/cli.py is missing")
    assert "transformers" not in _modules_after_import(f"import {module}")


def test_oracle_never_imports_probe():
    offenders = [p.name for p in (ROOT / "oracle").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+probe\b", p.read_text(), re.M)]
    assert offenders == []


def test_package_init_files_are_empty():
    assert (ROOT / "oracle" / "__init__.py").read_text() == "" and (ROOT / "probe" / "__init__.py").read_text() == ""
