"""Engine logs: lines written in each engine's own format (the format strings quoted from their source), parsed
and aggregated as the engine counts; malformed lines, a log with no acceptance line, and a k that differs are
bad input (exit 2 with the line); an engine number beside ours: inside -> exit 0, outside -> exit 1, said last."""

import re

import numpy as np
import pytest

from oracle.cli import cli
from oracle.engine_logs import parse_engine_log, vllm_depth
from oracle.errors import InputError
from tests.helpers import FIXTURES, run_cli

TRAINED = FIXTURES / "qwen3_5_trained"
HELDOUT = TRAINED / "heldout_tokens.txt"
# vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log (a %-format logger call; rates ", ".join(f"{p:.3f}"))
VLLM_FORMAT = ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
               "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
               "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%")
# tools/server: server_slot::print_timings (printf %0.5f, %5d)
LLAMA_FORMAT = "draft acceptance rate = %0.5f (%5d accepted / %5d generated)"
LLAMA_STATS_FORMAT = ("statistics %s: #calls(b,g,a) = %d %d %d, #gen drafts = %d, #acc drafts = %d, "
                      "#gen tokens = %d, #acc tokens = %d, p_acc_recent = %.3f")


def vllm_line(per_pos: list[int], drafts: int, k: int) -> str:
    """What vLLM logs for an interval: per_pos[j] = rounds with drafts 1..j+1 accepted, out of `drafts` rounds."""
    accepted = sum(per_pos)
    rates = ", ".join(f"{p / drafts:.3f}" for p in per_pos)
    body = VLLM_FORMAT % (1 + accepted / drafts, 12.5, 40.0, accepted, drafts * k, rates, 100 * accepted / (drafts * k))
    return f"INFO 12-01 10:00:00 [metrics.py:97] {body}"


def test_vllm_lines_are_summed_as_vllm_counts(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(["INFO starting", vllm_line([50, 30, 10], 60, 3), "noise", vllm_line([20, 5, 1], 40, 3)]))
    figures = {f.key: f.value for f in parse_engine_log(log)}
    assert figures["vllm_mean_acceptance_length"] == pytest.approx(1 + 116 / 100)
    assert figures["vllm_draft_acceptance_rate"] == pytest.approx(116 / 300)
    assert figures["vllm_rate_1"] == pytest.approx((round(50 / 60, 3) * 60 + round(20 / 40, 3) * 40) / 100)
    assert vllm_depth(parse_engine_log(log)) == 3


def test_sglang_prefers_the_cumulative_average(tmp_path):
    decode = ("[2026-12-01 10:00:00] Decode batch. #running-req: 1, #token: 300, token usage: 0.01, "
              "accept len: %.2f, accept rate: 0.45, cuda graph: True, gen throughput (token/s): 80.12, #queue-req: 0, ")
    log = tmp_path / "sglang.log"
    log.write_text("\n".join([decode % 2.0, decode % 3.0]))
    assert [f.value for f in parse_engine_log(log)] == [2.5]
    log.write_text("\n".join([decode % 2.0, '{"internal_states": [{"avg_spec_accept_length": 2.31, "load": 1}]}']))
    assert [f.value for f in parse_engine_log(log)] == [2.31]


def test_llama_cpp_per_request_lines_are_summed_and_stats_are_the_fallback(tmp_path):
    log = tmp_path / "llama.log"
    log.write_text("\n".join(["slot print_timings: id  0 | task 3 | " + LLAMA_FORMAT % (12 / 21, 12, 21),
                              "slot print_timings: id  0 | task 9 | " + LLAMA_FORMAT % (30 / 40, 30, 40)]))
    (f,) = parse_engine_log(log)
    assert (f.key, f.value) == ("llama_cpp_acceptance_rate", pytest.approx(42 / 61))
    log.write_text("\n".join([LLAMA_STATS_FORMAT % ("mtp", 1, 9, 9, 9, 7, 30, 20, 0.6),
                              LLAMA_STATS_FORMAT % ("mtp", 1, 20, 20, 20, 15, 60, 45, 0.7)]))
    assert parse_engine_log(log)[0].value == pytest.approx(45 / 60)  # cumulative: the last
    log.write_text("n_draft   = 4\nn_predict = 100\nn_drafted = 80\nn_accept  = 52\naccept    = 65.000%\n")
    assert parse_engine_log(log)[0].value == pytest.approx(52 / 80)


@pytest.mark.parametrize("text, message", [
    ("SpecDecoding metrics: Mean acceptance length: 2.1, Accepted: x tokens", "line 2: a vLLM"),
    ("draft acceptance rate = 0.5 (12 accepted)", "line 2: a llama.cpp"),
    ("draft acceptance rate = 0.50000 (   30 accepted /    20 generated)", "more accepted"),
    ("nothing about acceptance here", "no acceptance line"),
])
def test_malformed_logs_are_bad_input_with_the_line(tmp_path, text, message):
    log = tmp_path / "bad.log"
    log.write_text("first line\n" + text + "\n")
    with pytest.raises(InputError, match=message):
        parse_engine_log(log)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        parse_engine_log(fifo)


def accept_cli(*args):
    return run_cli(cli, ["accept", TRAINED, "--tokens-file", HELDOUT, "--main-model", "-q", *args])


def test_cli_bad_logs_exit_2_with_a_message_and_write_nothing(tmp_path):
    bad = tmp_path / "bad.log"
    bad.write_text("SpecDecoding metrics: Mean acceptance length: nope\n")
    out = tmp_path / "acc.json"
    r = accept_cli("--engine-log", bad, "--json", out)
    assert r.exit_code == 2 and "line 1: a vLLM" in r.output and "Traceback" not in r.output
    assert not out.exists()
    other_k = tmp_path / "k3.log"
    other_k.write_text(vllm_line([5, 3, 1], 10, 3) + "\n")
    r = accept_cli("--engine-log", other_k, "--k", "4")
    assert r.exit_code == 2 and "drafted k=3" in r.output and "--k 3" in r.output
    r = accept_cli("--engine-log", tmp_path / "missing.log")
    assert r.exit_code == 2
    r = accept_cli("--engine-log", bad, "--json", bad)  # an output that is an input
    assert r.exit_code == 2 and bad.read_text().startswith("SpecDecoding")


def test_cli_puts_the_engine_beside_ours_inside_exit_0_outside_exit_1(tmp_path):
    base = accept_cli("--k", "3", "--json", tmp_path / "ours.json")
    assert base.exit_code == 0, base.output
    import json

    ours = json.loads((tmp_path / "ours.json").read_text())
    per_pos = [int(n) for n in ours["alpha_num"]]  # our own counts: an engine that agrees exactly
    chains = ours["chains"]
    same = tmp_path / "same.log"
    same.write_text(vllm_line(per_pos, chains, 3) + "\n")
    r = accept_cli("--k", "3", "--engine-log", same)
    assert r.exit_code == 0, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("ACCEPT |") and "inside our 95% intervals" in last
    low = tmp_path / "low.log"  # the engine accepts far less: its loop or verification, not the head
    low.write_text(vllm_line([p // 3 for p in per_pos], chains, 3) + "\n")
    r = accept_cli("--k", "3", "--engine-log", low, "--json", tmp_path / "low.json")
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert re.search(r"engine vllm \S+=\d\.\d{3} OUTSIDE ours \d\.\d{3} \[", last), last
    verdict = json.loads((tmp_path / "low.json").read_text())["engine"]
    assert verdict["verdict"] == "diverged"
    assert any(c["verdict"] == "OUTSIDE" for c in verdict["comparisons"])
    assert np.isclose([c for c in verdict["comparisons"] if c["key"] == "vllm_mean_acceptance_length"][0]["ours"],
                      ours["e_len"])


def test_a_llama_cpp_rate_is_only_compared_under_the_gate_it_ran_with(tmp_path):
    log = tmp_path / "llama.log"
    log.write_text(LLAMA_FORMAT % (0.5, 30, 60) + "\n")
    r = accept_cli("--k", "2", "--engine-log", log)
    assert r.exit_code == 3 and "pass --p-min as the engine ran it" in r.output  # inconclusive, and why
    r = accept_cli("--k", "2", "--engine-log", log, "--p-min", "0.0")
    assert r.exit_code in (0, 1) and "llama_cpp_acceptance_rate" in r.output
