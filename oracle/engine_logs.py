"""What an engine logged about its own acceptance, read from its log, in the formats of the engines' source.

vLLM (vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log), one line per logging interval, counters reset after:
    "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted throughput:
     %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft
     acceptance rate: %.1f%%"   (rates: ", ".join(f"{p:.3f}"), one per draft position)
  Lines are summed: drafts per line = Drafted / k (k = the number of per-position rates), AL = 1 + ΣAccepted /
  Σdrafts, rate_j = Σ(rate_j · drafts) / Σdrafts, draft acceptance rate = ΣAccepted / ΣDrafted.
SGLang (srt/managers/scheduler*.py, the decode log; /server_info's internal_states):
    "Decode batch. #running-req: ..., accept len: {spec_accept_length:.2f}, [accept rate: {:.2f}, ]..."
    "avg_spec_accept_length": 2.31   (or avg_spec_accept_length=2.31 as the test harnesses print it)
  The cumulative avg_spec_accept_length wins (the last one); else the decode lines' mean, unweighted (the log does
  not say how many verify rounds each line covers).
llama.cpp (tools/server: one line per finished request; common/speculative.cpp; examples/speculative-simple):
    "draft acceptance rate = %0.5f (%5d accepted / %5d generated)"
    "statistics %s: #calls(b,g,a) = %zu %zu %zu, #gen drafts = %zu, #acc drafts = %zu, #gen tokens = %zu,
     #acc tokens = %zu, ..."   (cumulative: the last one per drafter)
    "n_drafted = %d" / "n_accept  = %d"   (speculative-simple, once at the end)
  The per-request lines are summed; without them the last statistics line; else speculative-simple's totals.

A line that begins like one of these but does not parse is bad input (exit 2 with its line number): a number read
wrong would be compared as if the engine had logged it.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from oracle.errors import InputError

NUM = r"(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan|inf)"
VLLM_MARK = "SpecDecoding metrics:"
VLLM = re.compile(
    rf"SpecDecoding metrics: Mean acceptance length: (?P<al>{NUM}), Accepted throughput: {NUM} tokens/s, "
    rf"Drafted throughput: {NUM} tokens/s, Accepted: (?P<accepted>\d+) tokens, Drafted: (?P<drafted>\d+) tokens, "
    rf"Per-position acceptance rate: (?P<rates>{NUM}(?:, {NUM})*), Avg Draft acceptance rate: (?P<rate>{NUM})%")
SGLANG_MARK = "accept len:"
SGLANG = re.compile(rf"Decode batch\..*accept len: (?P<len>{NUM})(?:, accept rate: (?P<rate>{NUM}))?")
SGLANG_AVG_MARK = "avg_spec_accept_length"
SGLANG_AVG = re.compile(rf"""avg_spec_accept_length['"]?\s*[:=]\s*(?P<len>{NUM})""")
LLAMA_MARK = "draft acceptance rate ="
LLAMA = re.compile(rf"draft acceptance rate = (?P<rate>{NUM}) \(\s*(?P<accepted>\d+) accepted /\s*(?P<generated>\d+) "
                   rf"generated\)")
LLAMA_STATS_MARK = "#gen tokens ="
LLAMA_STATS = re.compile(r"statistics (?P<type>\S+): .*#gen drafts = (?P<drafts>\d+), #acc drafts = \d+, "
                         r"#gen tokens = (?P<generated>\d+), #acc tokens = (?P<accepted>\d+)")
LLAMA_SIMPLE = re.compile(r"n_(?P<what>drafted|accept)\s*=\s*(?P<n>\d+)\s*$")


@dataclass(frozen=True)
class EngineFigure:
    """An engine's number under one of accept's conventions (accept_conventions.Figure.key)."""

    engine: str
    key: str
    value: float
    source: str  # which lines, how aggregated


@dataclass
class _Counts:
    vllm: list = field(default_factory=list)  # (al, accepted, drafted, rates)
    sglang: list = field(default_factory=list)  # decode-line accept len
    sglang_avg: list = field(default_factory=list)
    llama: list = field(default_factory=list)  # (accepted, generated)
    llama_stats: dict = field(default_factory=dict)  # type -> (accepted, generated)
    llama_simple: dict = field(default_factory=dict)


def parse_engine_log(path: Path) -> list[EngineFigure]:
    """Every acceptance figure the log holds; exit 2 (InputError) for an unreadable log, a malformed line of a
    known format, inconsistent depths, or a log with no acceptance line at all."""
    path = Path(path)
    if not path.is_file():  # a FIFO or a device would block or never end
        raise InputError(f"--engine-log {path}: not a regular file; save the engine's log to a file first.")
    counts = _Counts()
    try:
        with path.open(encoding="utf-8", errors="replace") as lines:  # line by line: a long log is not held whole
            for number, line in enumerate(lines, start=1):
                _read_line(counts, line.rstrip("\r\n"), path, number)
    except OSError as err:
        raise InputError(f"--engine-log {path}: cannot read it ({err.strerror or err}).") from None
    figures = _vllm(counts, path) + _sglang(counts) + _llama(counts)
    if not figures:
        raise InputError(f"--engine-log {path}: no acceptance line found. Expected vLLM's '{VLLM_MARK} ...', "
                         f"SGLang's '... accept len: X' or 'avg_spec_accept_length', or llama.cpp's "
                         f"'{LLAMA_MARK} R (A accepted / G generated)' (see mtp-oracle accept --help).")
    return figures


def _bad(path: Path, number: int, what: str, line: str) -> InputError:
    shown = line.strip()
    shown = shown if len(shown) <= 160 else shown[:157] + "..."
    return InputError(f"--engine-log {path}, line {number}: {what} does not parse: {shown!r}. Pass the engine's "
                      f"log unchanged (the format is quoted in mtp-oracle accept --help).")


def _read_line(counts: _Counts, line: str, path: Path, number: int) -> None:
    if VLLM_MARK in line:
        m = VLLM.search(line)
        if m is None:
            raise _bad(path, number, "a vLLM 'SpecDecoding metrics' line", line)
        rates = tuple(float(v) for v in m["rates"].split(", "))
        counts.vllm.append((float(m["al"]), int(m["accepted"]), int(m["drafted"]), rates, number))
    elif LLAMA_MARK in line:
        m = LLAMA.search(line)
        if m is None:
            raise _bad(path, number, "a llama.cpp 'draft acceptance rate' line", line)
        accepted, generated = int(m["accepted"]), int(m["generated"])
        if accepted > generated:
            raise _bad(path, number, f"a llama.cpp line with more accepted ({accepted}) than generated "
                                     f"({generated})", line)
        counts.llama.append((accepted, generated))
    elif LLAMA_STATS_MARK in line and "statistics" in line:
        m = LLAMA_STATS.search(line)
        if m is None:
            raise _bad(path, number, "a llama.cpp speculative 'statistics' line", line)
        counts.llama_stats[m["type"]] = (int(m["accepted"]), int(m["generated"]))
    elif SGLANG_AVG_MARK in line:
        m = SGLANG_AVG.search(line)
        if m is None:
            raise _bad(path, number, "an SGLang avg_spec_accept_length value", line)
        counts.sglang_avg.append(float(m["len"]))
    elif SGLANG_MARK in line and "Decode batch" in line:
        m = SGLANG.search(line)
        if m is None:
            raise _bad(path, number, "an SGLang 'Decode batch' line", line)
        counts.sglang.append(float(m["len"]))
    else:
        m = LLAMA_SIMPLE.search(line)
        if m is not None:
            counts.llama_simple[m["what"]] = int(m["n"])


def _vllm(counts: _Counts, path: Path) -> list[EngineFigure]:
    lines = [entry for entry in counts.vllm if entry[2] > 0]  # an interval with no drafts says nothing
    if not lines:
        return []
    depths = {len(entry[3]) for entry in lines}
    if len(depths) > 1:
        raise InputError(f"--engine-log {path}: vLLM lines with different numbers of per-position rates "
                         f"({sorted(depths)}): the engine ran more than one k; give one run's log.")
    k = depths.pop()
    drafts = [drafted / k for _, _, drafted, _, _ in lines]
    total = sum(drafts)
    accepted = sum(entry[1] for entry in lines)
    source = f"{len(lines)} vLLM 'SpecDecoding metrics' lines, summed (drafts = Drafted / k, k={k})"
    figures = [EngineFigure("vllm", "vllm_mean_acceptance_length", 1 + accepted / total, source),
               EngineFigure("vllm", "vllm_draft_acceptance_rate", accepted / sum(e[2] for e in lines), source)]
    for j in range(k):
        rate = sum(entry[3][j] * n for entry, n in zip(lines, drafts)) / total
        figures.append(EngineFigure("vllm", f"vllm_rate_{j + 1}", rate, source))
    return figures


def vllm_depth(figures: list[EngineFigure]) -> int | None:
    """The k the vLLM run drafted (its number of per-position rates), or None without vLLM lines."""
    return sum(1 for f in figures if f.key.startswith("vllm_rate_")) or None


def _sglang(counts: _Counts) -> list[EngineFigure]:
    if counts.sglang_avg:
        return [EngineFigure("sglang", "sglang_avg_spec_accept_length", counts.sglang_avg[-1],
                             "SGLang avg_spec_accept_length (cumulative; the last one logged)")]
    if counts.sglang:
        return [EngineFigure("sglang", "sglang_avg_spec_accept_length", sum(counts.sglang) / len(counts.sglang),
                             f"mean of {len(counts.sglang)} SGLang 'accept len' decode lines, unweighted (the log "
                             f"does not give each line's verify rounds)")]
    return []


def _llama(counts: _Counts) -> list[EngineFigure]:
    if counts.llama:
        accepted, generated = (sum(v) for v in zip(*counts.llama))
        source = f"{len(counts.llama)} llama.cpp 'draft acceptance rate' lines, summed"
    elif counts.llama_stats:
        accepted, generated = (sum(v) for v in zip(*counts.llama_stats.values()))
        source = f"llama.cpp speculative statistics of {', '.join(counts.llama_stats)} (cumulative; the last)"
    elif {"drafted", "accept"} <= set(counts.llama_simple):
        accepted, generated = counts.llama_simple["accept"], counts.llama_simple["drafted"]
        source = "llama.cpp speculative-simple n_accept / n_drafted"
    else:
        return []
    if generated == 0:
        return []
    return [EngineFigure("llama.cpp", "llama_cpp_acceptance_rate", accepted / generated,
                         f"{source}: {accepted} accepted / {generated} generated")]
