"""Paths of the committed fixtures and small helpers shared by the tests (import as `tests.helpers`)."""

import importlib.util
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TINY = FIXTURES / "qwen3_5_tiny"
TINY_SHARDED = FIXTURES / "qwen3_5_tiny_sharded"
TINY_REF = FIXTURES / "qwen3_5_tiny_ref.h5"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(cli, args: list) -> "click.testing.Result":
    """Invoke a click CLI in-process; the Result has exit_code, output and exception."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)
