"""--main-model runs print no transformers notices about causal_conv1d / flash-linear-attention falling back to
their reference PyTorch implementation (the path an oracle wants); other warnings still pass."""

import logging
import subprocess
import sys

from oracle.export import quiet_kernel_fallbacks
from tests.helpers import ROOT

NOTICE = ("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because `causal_conv1d` is "
          "not installed. This is correct but much slower; install `causal_conv1d` for the optimized kernel.")


def _emitted(message: str, quiet: bool) -> list[str]:
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        if quiet:
            with quiet_kernel_fallbacks():
                logger.warning(message)
        else:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def test_the_fallback_notice_is_dropped_only_inside_the_block_and_other_warnings_pass():
    assert _emitted(NOTICE, quiet=True) == []
    assert _emitted(NOTICE, quiet=False) == [NOTICE]  # the twin: outside the block it would be printed
    assert _emitted("something else went wrong", quiet=True) == ["something else went wrong"]


def test_a_main_model_export_prints_no_fallback_notice(tmp_path):
    result = subprocess.run([sys.executable, "-m", "oracle", "export", ROOT / "fixtures" / "qwen3_5_trained",
                             "--out", tmp_path / "mm.h5", "--tokens", "5,17,3", "--main-model", "--first-token", "1"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "running the main model" in result.stderr and "falling back" not in result.stderr
