"""pytest plugin: a reference trace exported once per test run, for tests that use probe.testing.

Registered as the `pytest11` entry point `mtp_probe` (pyproject.toml), so every pytest run in an environment where
mtp-probe is installed loads it. Its import is therefore kept light (pytest and pathlib only): torch, transformers
and h5py are imported only when a test asks for the fixture.

Fixtures (session scope):
    mtp_reference_spec  a probe.testing.ReferenceSpec read from the ini options below; override it in your
                        conftest.py to build the spec in code
    mtp_reference       the Path of an mtp-trace/1 reference exported from that spec into the session's temporary
                        directory (once per run; per worker under pytest-xdist). Override it to use a stored trace.

ini options ([tool.pytest.ini_options] or [pytest]; paths relative to the ini file):
    mtp_probe_checkpoint   checkpoint directory (HF layout: config.json + safetensors)
    mtp_probe_tokens       step token ids t_1..t_T, comma or whitespace separated (T >= 2, or every verdict is at
                           best inconclusive)
    mtp_probe_hidden_seed  synthetic hidden H from this seed (default 0)
    mtp_probe_hidden       or H from a file: F.npy, F.bin (raw little-endian float32 [T, D]) or F.h5:/dataset
    mtp_probe_start_pos    position of step 0 (default 0)
"""

from pathlib import Path

import pytest

INI_OPTIONS = {
    "mtp_probe_checkpoint": "mtp-probe: checkpoint directory the mtp_reference fixture exports from",
    "mtp_probe_tokens": "mtp-probe: step token ids t_1..t_T for the mtp_reference fixture, e.g. 5,17,3,42",
    "mtp_probe_hidden_seed": "mtp-probe: synthetic hidden H from this seed (default 0)",
    "mtp_probe_hidden": "mtp-probe: hidden H from F.npy, F.bin or F.h5:/dataset instead of a seed",
    "mtp_probe_start_pos": "mtp-probe: position of step 0 (default 0)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    for name, help_text in INI_OPTIONS.items():
        parser.addini(name, help_text, default="")


def _ini(config: pytest.Config, name: str) -> str:
    return str(config.getini(name) or "").strip()


def _ini_path(config: pytest.Config, value: str) -> Path:
    base = config.inipath.parent if config.inipath else config.rootpath
    return (base / value).resolve()


def _ini_int(config: pytest.Config, name: str, default: int | None) -> int | None:
    value = _ini(config, name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"ini option {name} = {value!r} is not an integer.") from None


@pytest.fixture(scope="session")
def mtp_reference_spec(pytestconfig: pytest.Config):
    """The reference to export, from the mtp_probe_* ini options (override this fixture to build it in code)."""
    from probe.testing import ReferenceSpec

    checkpoint, tokens = _ini(pytestconfig, "mtp_probe_checkpoint"), _ini(pytestconfig, "mtp_probe_tokens")
    if not checkpoint or not tokens:
        pytest.fail("the mtp_reference fixture needs a checkpoint and tokens: set the ini options "
                    "mtp_probe_checkpoint and mtp_probe_tokens (e.g. in [tool.pytest.ini_options]), or override "
                    "the mtp_reference_spec fixture in conftest.py to return a probe.testing.ReferenceSpec.",
                    pytrace=False)
    hidden = _ini(pytestconfig, "mtp_probe_hidden")
    seed = _ini_int(pytestconfig, "mtp_probe_hidden_seed", None if hidden else 0)
    if hidden and seed is not None:
        raise pytest.UsageError("give one of the ini options mtp_probe_hidden and mtp_probe_hidden_seed, not both.")
    from oracle.inputs import token_ids_from_text

    return ReferenceSpec(checkpoint=_ini_path(pytestconfig, checkpoint),
                         tokens=tuple(token_ids_from_text(tokens, "ini option mtp_probe_tokens").tolist()),
                         hidden_seed=seed, hidden_file=str(_ini_path(pytestconfig, hidden)) if hidden else None,
                         start_pos=_ini_int(pytestconfig, "mtp_probe_start_pos", 0))


@pytest.fixture(scope="session")
def mtp_reference(mtp_reference_spec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mtp-trace/1 reference exported once per test session from `mtp_reference_spec`."""
    from oracle.errors import MtpError
    from oracle.export import HiddenSource, export_trace

    spec = mtp_reference_spec
    out = tmp_path_factory.mktemp("mtp-reference") / "ref.h5"
    hidden = HiddenSource(file=spec.hidden_file, seed=spec.hidden_seed if spec.hidden_file is None else None)
    try:
        return Path(export_trace(Path(spec.checkpoint), out, list(spec.tokens), hidden, start_pos=spec.start_pos,
                                 command=f"pytest fixture mtp_reference ({spec})"))
    except MtpError as err:
        pytest.fail(f"mtp_reference: exporting the reference failed: {err}", pytrace=False)
