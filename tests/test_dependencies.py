"""Which way imports point: probe never pulls in transformers; the checkpoint/trace layer needs neither
transformers nor torch; oracle never imports probe. And when the heavy imports happen: never for --help, argument
or input errors found before the head runs, inspect or inputs; an export loads only its family's transformers
models."""

import re
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF

HEAVY = {"torch", "transformers"}


def _modules_after_import(statement: str) -> set[str]:
    code = f"{statement}; import sys; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def _modules_after_cli(package: str, *args) -> tuple[int, set[str], str]:
    """(exit status, sys.modules at the end, stderr) of `package`'s CLI run as the program (its own exit path)."""
    code = ("import atexit, sys; atexit.register(lambda: print('MODULES', *sorted(sys.modules), file=sys.stderr)); "
            f"from {package}.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    modules = next(line for line in result.stderr.splitlines() if line.startswith("MODULES ")).split()[1:]
    return result.returncode, set(modules), result.stderr


def test_checkpoint_trace_and_stages_import_neither_torch_nor_transformers():
    loaded = _modules_after_import("import oracle.checkpoint, oracle.trace, oracle.stages, oracle.errors")
    assert "transformers" not in loaded and "torch" not in loaded


def test_the_export_and_cli_modules_import_neither_torch_nor_transformers():
    """export_trace loads the family's torch half itself, beside its first checkpoint reads."""
    assert not HEAVY & _modules_after_import("import oracle.cli, oracle.export, oracle.inspect")


@pytest.mark.parametrize("args, status", [
    (["--help"], 0), (["export", "--help"], 0), (["accept", "--help"], 0),
    (["export", TINY, "--out", "OUT"], 2),  # no --tokens: a usage error
    (["export", TINY, "--out", "OUT", "--tokens", "1,2", "--hidden-seed", "0", "--main-model"], 2),
    (["export", TINY, "--out", "OUT", "--tokens", "100000", "--hidden-seed", "0"], 2),  # id beyond vocab_size
    (["export", FIXTURES / "legacy", "--out", "OUT", "--tokens", "1", "--hidden-seed", "0"], 2),  # no config.json
    (["accept", TINY, "--tokens", "1,2,3"], 2),  # no hidden source
    (["inspect", TINY_REF], 0), (["inputs", TINY_REF, "--out-dir", "OUT"], 0),
], ids=lambda v: " ".join(map(str, v)).replace(str(ROOT) + "/", "") if isinstance(v, list) else str(v))
def test_cli_paths_that_run_no_head_load_neither_torch_nor_transformers(args, status, tmp_path):
    args = [tmp_path / "out" if a == "OUT" else a for a in args]
    code, loaded, stderr = _modules_after_cli("oracle", *args)
    assert code == status, stderr
    assert not HEAVY & loaded


@pytest.mark.parametrize("fixture, models", [
    # the Qwen stem (oracle/families/qwen3_5_stem.py) imports no model: each Qwen family loads only its own classes
    ("qwen3_5_tiny", {"qwen3_5"}), ("qwen3_5_moe_tiny", {"qwen3_5_moe"}), ("qwen3_next_tiny_fused", {"qwen3_next"}),
    # the shared torch parts (oracle/families/torch_parts.py) are no family's: the others load only their own
    ("mimo_v2_flash_tiny", {"mimo_v2_flash"}), ("step3p7_tiny", {"step3p7"}), ("deepseek_v3_tiny", {"deepseek_v3"}),
    ("glm4_moe_tiny", {"glm4_moe"}),
])
def test_an_export_loads_only_its_familys_transformers_models(fixture, models, tmp_path):
    code, loaded, stderr = _modules_after_cli("oracle", "export", FIXTURES / fixture, "--out", tmp_path / "ref.h5",
                                              "--tokens", "1,2,3", "--hidden-seed", "0", "-q")
    assert code == 0, stderr
    # transformers.models.<model>.modeling_<model>: one model's classes (auto's registry is not a model)
    modelling = {m.split(".")[2] for m in loaded if re.fullmatch(r"transformers\.models\.(\w+)\.modeling_\1", m)}
    assert modelling - {"auto"} == models


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


# The seam (oracle/families/spec.py): outside oracle/families/ only these import a family's own module, each for a
# stated reason. A new entry needs one; the twin below shows the scan finds such an import.
FAMILY_IMPORT_EXCEPTIONS = {
    "probe/adapters/cabi_worker.py": "ABI v1's fixed structs describe the Qwen3.5 dense head only (v2 is generic)",
}
GENERIC_FAMILY_MODULES = ("registry", "spec", "routing_evidence", "moe_experts", "torch_parts")  # family-agnostic
_FAMILY_IMPORT = re.compile(r"^\s*(from|import)\s+oracle\.families\.(?!(?:" + "|".join(GENERIC_FAMILY_MODULES)
                            + r")\b)\w+", re.M)


def family_imports(paths, root=ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in paths if _FAMILY_IMPORT.search(p.read_text()))


def test_no_family_module_is_imported_outside_the_families():
    outside = [*(ROOT / "oracle").glob("*.py"), *(ROOT / "probe").rglob("*.py")]
    assert family_imports(outside) == sorted(FAMILY_IMPORT_EXCEPTIONS)


def test_the_family_import_scan_finds_one(tmp_path):
    """Twin: the scan above would notice a family import in a new file, and not the seam's own modules."""
    (tmp_path / "planted.py").write_text("import os\nfrom oracle.families.qwen3_5_layout import LM_HEAD\n")
    (tmp_path / "seam.py").write_text("from oracle.families.registry import detect\nfrom oracle.families.spec import X\n")
    assert family_imports(sorted(tmp_path.glob("*.py")), tmp_path) == ["planted.py"]
