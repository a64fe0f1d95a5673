"""Issue 28 ("as a user meets it, round 2"): the waits say what loads, --main-model on a head-only checkpoint is
refused before anything loads, and the messages a new user met read right. Each behaviour has its twin."""

import subprocess
import sys

from oracle.cli import cli as oracle_cli
from probe.cli import cli as probe_cli
from tests.helpers import FIXTURES, ROOT, TINY, TINY_REF, run_cli

HEAD_ONLY = FIXTURES / "qwen3_next_tiny_fused"


def test_main_model_on_a_head_only_checkpoint_is_refused_before_torch_loads(tmp_path):
    """In a fresh process: the message names the checkpoint, says it holds no main model and suggests --hidden /
    --hidden-seed; torch was never imported (the refusal comes before the slow part)."""
    code = ("import sys\nfrom oracle.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', file=sys.stderr)\n"
            "    raise\n")
    for command in (["export", str(HEAD_ONLY), "--out", str(tmp_path / "r.h5"), "--tokens", "1,2,3", "--main-model",
                     "--first-token", "4"],
                    ["accept", str(HEAD_ONLY), "--tokens", "1,2,3,4,5,6,7", "--main-model", "--k", "2"]):
        proc = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "holds no main model" in proc.stderr and "--hidden FILE" in proc.stderr
        assert "--hidden-seed N" in proc.stderr and "torch not loaded" in proc.stderr
        assert "missing" not in proc.stderr.lower()  # not torch's missing-keys list
    assert not (tmp_path / "r.h5").exists()


def test_twin_main_model_on_a_whole_checkpoint_runs(tmp_path):
    result = run_cli(oracle_cli, ["export", TINY, "--out", tmp_path / "r.h5", "--tokens", "5,17,3", "--main-model",
                                  "--first-token", "9"])
    assert result.exit_code == 0, result.output
    assert "holds no main model" not in result.output and "loading torch and transformers" in result.output


def test_explain_says_it_loads_torch_and_q_silences_it(tmp_path):
    args = ["diff", TINY_REF, TINY_REF, "--explain", "--checkpoint", TINY]
    loud, quiet = run_cli(probe_cli, args), run_cli(probe_cli, [*args, "-q"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output
    assert "--explain: loading torch and transformers" in loud.output
    assert "loading torch" not in quiet.output  # twin


def test_accept_says_it_loads_torch(tmp_path):
    result = run_cli(oracle_cli, ["accept", FIXTURES / "qwen3_5_trained", "--tokens", "1,2,3,4,5,6,7,8",
                                  "--hidden-seed", "0", "--target", "text", "--k", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.index("loading torch and transformers") < result.output.index("ACCEPT |")
    quiet = run_cli(oracle_cli, ["accept", FIXTURES / "qwen3_5_trained", "--tokens", "1,2,3,4,5,6,7,8",
                                 "--hidden-seed", "0", "--target", "text", "--k", "2", "-q"])
    assert quiet.exit_code == 0 and "loading torch" not in quiet.output
