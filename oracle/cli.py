"""`mtp-oracle`: export reference traces of an MTP head and inspect them."""

import re
import shlex
import signal
import sys
from pathlib import Path

import click

from oracle.errors import MtpGroup
from oracle.output import check_writable, figure_format, refuse_overwriting_inputs
from oracle.progress import reporting, say

EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
CHECKPOINT = click.Path(exists=True, path_type=Path)  # a folder in the HF layout, or a GGUF file


class _AsciiDigits:
    """An integer option written in ASCII digits: Python's int() also takes full-width digits ('１７') and
    underscores ('1_7'), which --tokens refuses too (oracle/inputs.py)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
            self.fail(f"{value!r} is not an integer written in ASCII digits 0-9.", param, ctx)
        return super().convert(value, param, ctx)


class AsciiInt(_AsciiDigits, click.types.IntParamType):
    pass


class AsciiIntRange(_AsciiDigits, click.IntRange):
    pass


INT = AsciiInt()


@click.group(cls=MtpGroup)
@click.version_option(package_name="mtp-probe", prog_name="mtp-oracle", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Reference traces for Multi-Token-Prediction draft heads, from the official transformers layers."""
    ctx.obj = ctx.obj or {"command": shlex.join(["mtp-oracle", *sys.argv[1:]])}


def step_input_options(tokens_note: str):
    """The options that say what a trace's steps read (tokens, H, positions): export and noise take the same."""
    options = [
        click.option("--tokens", help=f"Step token ids t_1..t_T, comma separated ({tokens_note})."),
        click.option("--tokens-file", type=EXISTING_FILE, help="Step token ids from a text file or a .npy int array."),
        click.option("--hidden", "hidden_file", metavar="FILE",
                     help="H [T, D] float32: FILE.npy, FILE.bin (raw little-endian) or FILE.h5:/dataset."),
        click.option("--hidden-seed", type=INT, help="Synthetic H: standard normal rows from this seed."),
        click.option("--main-model", is_flag=True, help="H from the checkpoint's main model (post-final-norm)."),
        click.option("--first-token", type=AsciiIntRange(0, 2**63 - 1),
                     help="With --main-model: x_0, the token before the first step token."),
        click.option("--start-pos", type=INT, default=0, show_default=True, help="Position p_0 of step 0."),
    ]

    def apply(command):
        for option in reversed(options):  # click lists options in decorator order, top first
            command = option(command)
        return command
    return apply


@cli.command(epilog="""\b
Examples:
  mtp-oracle export fixtures/qwen3_5_tiny --out ref.h5 --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0
  mtp-oracle export CHECKPOINT --out ref.h5 --tokens-file steps.txt --hidden H.npy --start-pos 100
  mtp-oracle export CHECKPOINT --out ref.h5 --tokens 17,42,3 --main-model --first-token 9 --mode stepwise
  mtp-oracle export fixtures/qwen3_5_tiny --out chain.h5 --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0 --chain 4
""")
@click.argument("checkpoint", type=CHECKPOINT)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Trace file to write (HDF5).")
@step_input_options("already shifted: step i reads t_{i+1}")
@click.option("--norm-topk-prob/--no-norm-topk-prob", default=None,
              help="MoE heads: renormalise the top-k router weights to sum 1, or not [default: config.json's "
                   "norm_topk_prob; without the key, transformers' convention (Qwen3.5-MoE: on)]. Recorded in the "
                   "trace.")
@click.option("--mask-pos0-embedding", is_flag=True,
              help="DeepSeek/GLM heads: zero the embedding at absolute position 0 before enorm, as vLLM does "
                   "[default: off, as transformers' MtpLayer and SGLang]. Recorded in the trace.")
@click.option("--mode", type=click.Choice(["batched", "stepwise"]), default="batched", show_default=True,
              help="One causal pass over all steps, or one step at a time through the KV cache.")
@click.option("--chain", type=INT, metavar="K",
              help="Also record the draft loop: depths 2..K of the chain from every bridge step that has the tokens "
                   "(/chain/d{j}; K <= T). One-layer heads drop a chain's KV rows after it.")
@click.option("--chain-tokens", type=click.Choice(["teacher", "argmax"]), default="teacher", show_default=True,
              help="With --chain: feed depth j the step token x_{i+j} (teacher-forced), or the head's own draft j-1.")
@click.option("--recycle", metavar="STAGE",
              help="With --chain: the stage depth j-1 hands to depth j as its hidden [default: the family's "
                   "convention, recorded in the trace: out; DeepSeek-V4 block_out]. E.g. res2: the un-normed "
                   "residual vLLM's GLM-4.5 MTP recycles.")
@click.option("--chain-layers", type=click.Choice(["per-depth", "modulo"]), default="per-depth", show_default=True,
              help="With --chain on an N-layer head: depth j runs layer j-1 (transformers' MtpModel; K <= N), or "
                   "layer (j-1) % N (vLLM's spec_step_idx % N, which allows K > N).")
@click.option("--chain-kv", type=click.Choice(["teacher-forced", "engine"]), default="teacher-forced",
              show_default=True,
              help="With --chain-tokens argmax on an N-layer head: what each layer's cache holds of the earlier "
                   "chains. teacher-forced: their teacher-forced rows (transformers' MtpModel recomputes them over "
                   "the prefix); engine: the rows those chains wrote at that depth, in the engine's order (bridge "
                   "i, its chain, bridge i+1: vLLM).")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
@click.pass_obj
def export(obj, checkpoint, out, tokens, tokens_file, hidden_file, hidden_seed, main_model, first_token, start_pos,
           norm_topk_prob, mask_pos0_embedding, mode, chain, chain_tokens, recycle, chain_layers, chain_kv,
           quiet) -> None:
    """Run the head on T teacher-forced steps and write every stage to an mtp-trace/1 file."""
    from oracle.export import ChainOptions, HiddenSource, export_trace  # no torch: export_trace loads it later
    from oracle.inputs import token_ids_from_file, token_ids_from_text

    _exactly_one({"--tokens": tokens, "--tokens-file": tokens_file})
    given = [o for o, v in (("--chain-tokens argmax", chain_tokens == "argmax" or None), ("--recycle", recycle),
                            ("--chain-layers modulo", chain_layers == "modulo" or None),
                            ("--chain-kv engine", chain_kv == "engine" or None)) if v]
    if chain is None and given:  # else silently ignored
        raise click.UsageError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --chain K.")
    _exactly_one({"--hidden": hidden_file, "--hidden-seed": hidden_seed, "--main-model": main_model or None})
    _refuse_overwriting_inputs({"--out": out}, checkpoint, tokens_file, hidden_file)
    ids = token_ids_from_file(tokens_file) if tokens_file else token_ids_from_text(tokens, "--tokens")
    source = HiddenSource(file=hidden_file, seed=hidden_seed, main_model=main_model, first_token=first_token)
    log = (lambda msg: None) if quiet else say
    overrides = {} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}
    if mask_pos0_embedding:  # a head config field (trace config); refused for families without the convention
        overrides["mask_pos0_embedding"] = True
    with reporting(enabled=not quiet):
        path = export_trace(checkpoint, out, ids, source, start_pos=start_pos, mode=mode, config_overrides=overrides,
                            command=obj["command"], log=log, warn=lambda msg: click.echo(msg, err=True),
                            chain=None if chain is None else ChainOptions(chain, chain_tokens, recycle, chain_layers,
                                                                                  chain_kv))
    from oracle.output import staged_path
    from oracle.trace import read_trace

    with read_trace(staged_path(path)) as written:  # put in place when the command ends
        count = len(written.stages)
    depths = f", depths 2..{chain} of the chains" if chain is not None else ""
    click.echo(f"wrote {path}: {len(ids)} step{'s' if len(ids) != 1 else ''} x {count} stages{depths}")


@cli.command(epilog="""\b
Examples:
  mtp-oracle accept fixtures/qwen3_5_trained --tokens-file fixtures/qwen3_5_trained/heldout_tokens.txt --main-model
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden H.npy --json acc.json --plot acc.png
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden-seed 0 --target text -q
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden H.npy --quantize '*=int8' --quantize '*.mlp.*=int4'
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden H.npy --p-min 0.75 --temperature 0.7
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden H.npy --k 3 --engine-log vllm.log --positions 0:512
  mtp-oracle accept CHECKPOINT --tokens-file text.txt --hidden H.npy --device H200 --context 4096

\b
--engine-log reads (format as in each engine's source):
  vLLM:      SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s,
             Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens,
             Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%
  SGLang:    Decode batch. ... accept len: %.2f, ...   or   "avg_spec_accept_length": %f
  llama.cpp: draft acceptance rate = %0.5f (%5d accepted / %5d generated)
             statistics TYPE: ... #gen drafts = N, #acc drafts = N, #gen tokens = N, #acc tokens = N
             n_drafted = %d / n_accept  = %d
Exit 1 when an engine's figure falls outside our 95% interval, 3 when none could be decided.
""")
@click.argument("checkpoint", type=CHECKPOINT)
@click.option("--k", type=INT, default=4, show_default=True, help="Drafts per chain (speculation depth).")
@click.option("--tokens", help="The sequence x_0..x_{N-1}, comma separated (NOT shifted: bridge step i reads x_{i+1}).")
@click.option("--tokens-file", type=EXISTING_FILE, help="The sequence from a text file or a .npy int array.")
@click.option("--hidden", "hidden_file", metavar="FILE",
              help="H_0..H_{N-1} [N, D] float32, post-final-norm: FILE.npy, FILE.bin or FILE.h5:/dataset.")
@click.option("--main-model", is_flag=True, help="H from the checkpoint's main model run over the sequence.")
@click.option("--hidden-seed", type=INT, help="Synthetic H (plumbing checks only; implies --target text).")
@click.option("--target", type=click.Choice(["greedy", "text"]), help="Compare drafts with the main model's argmax "
              "(greedy; default) or with the sequence's next tokens (text; a proxy).")
@click.option("--chunk-rows", type=INT, default=8192, show_default=True,
              help="lm_head rows read (and held in float32) at a time.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the measurement as JSON.")
@click.option("--quantize", multiple=True, metavar="GLOB=SCHEME",
              help="Also measure the head with the tensors GLOB matches (fnmatch on checkpoint names) quantized "
                   "and dequantized (simulated): int8 (per output row), int4 (groups of 32; int4g64, int4g128), "
                   "fp8 (e4m3, 128x128 blocks), int2 (ternary). Repeatable; a later spec wins. Reports both "
                   "heads on the same chains and the difference.")
@click.option("--plot", type=click.Path(path_type=Path),
              help="Write a picture of alpha_j and p_j by depth (.png, .jpg, .svg or .pdf).")
@click.option("--p-min", type=float, help="Simulate llama.cpp's --spec-draft-p-min gate: a draft is proposed only "
              "while the head's own top probability is >= P (needs the exact distributions: slower).")
@click.option("--p-min-top-k", type=INT, default=10, show_default=True,
              help="The gate's probability is the softmax over the top K logits (llama.cpp's draft sampler: "
                   "top_k 10); 0: the whole vocabulary.")
@click.option("--n-min", type=INT, default=0, show_default=True,
              help="llama.cpp's --spec-draft-n-min: a gated draft shorter than this is dropped.")
@click.option("--temperature", type=float, help="Sampled verification at this temperature: each draft accepted "
              "with the rejection-sampling probability, expected over the exact distributions (default greedy).")
@click.option("--draft-sampling", type=click.Choice(["greedy", "sampled"]), default="greedy", show_default=True,
              help="With --temperature: drafts are the head's argmax (acceptance p(draft), as vLLM's MTP/EAGLE "
                   "proposers) or sampled from its softmax (acceptance sum_v min(p_v, q_v)).")
@click.option("--positions", metavar="FIRST:LAST", help="Only the chains after bridge steps FIRST..LAST-1.")
@click.option("--buckets", type=INT, default=4, show_default=True,
              help="Rows of the table along the sequence (contiguous ranges of context positions).")
@click.option("--bandwidth", help="Memory bandwidth for the speed table (e.g. 4.8TB/s): decode at batch 1 is "
              "memory-bound, a step's time is its bytes over this.")
@click.option("--device", help="A device profile for the speed table: H100, H200, B200, MI300X, MI325X (bandwidth and "
              "bf16 peak), or cpu (this machine's bandwidth, measured now).")
@click.option("--main-step-ms", type=float, help="The engine's measured plain decode step (ms); with "
              "--draft-step-ms they win over the model.")
@click.option("--draft-step-ms", type=float, help="The engine's measured draft step (ms).")
@click.option("--context", type=INT, help="Context length for the KV-cache terms of the speed table (default: N).")
@click.option("--engine-log", type=EXISTING_FILE, help="An engine's log for the same text (vLLM, SGLang or "
              "llama.cpp): its acceptance beside ours under the same convention, with our interval.")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
@click.pass_obj
def accept(obj, checkpoint, k, tokens, tokens_file, hidden_file, main_model, hidden_seed, target, chunk_rows,
           quantize, json_out, plot, p_min, p_min_top_k, n_min, temperature, draft_sampling, positions, buckets,
           bandwidth, device, main_step_ms, draft_step_ms, context, engine_log, quiet) -> None:
    """Measure the head's acceptance: conditional alpha_j and chain-break E[len] over k-draft chains."""
    from oracle.export import HiddenSource
    from oracle.inputs import token_ids_from_file, token_ids_from_text

    _exactly_one({"--tokens": tokens, "--tokens-file": tokens_file})
    _exactly_one({"--hidden": hidden_file, "--main-model": main_model or None, "--hidden-seed": hidden_seed})
    _refuse_overwriting_inputs({"--json": json_out, "--plot": plot}, checkpoint, tokens_file, hidden_file,
                               {"--engine-log": engine_log})
    for path, option in ((json_out, "--json"), (plot, "--plot")):
        if path is not None:
            check_writable(path, option)  # fail before the work, not after it
    if plot is not None:
        figure_format(plot, "--plot")  # the extension names the format; one it cannot write is refused now
    ids = token_ids_from_file(tokens_file) if tokens_file else token_ids_from_text(tokens, "--tokens")
    from oracle.accept_conventions import Settings, parse_positions  # no torch
    from oracle.engine_logs import parse_engine_log, vllm_depth
    from oracle.errors import InputError
    from oracle.quantize_sim import parse_spec

    specs = tuple(parse_spec(text) for text in quantize)
    settings = Settings(k=k, p_min=p_min, p_min_top_k=p_min_top_k, n_min=n_min, temperature=temperature,
                        draft_sampling=draft_sampling, positions=parse_positions(positions), buckets=buckets)
    engine = None if engine_log is None else parse_engine_log(engine_log)  # a bad log before the work
    from oracle.speedup import clock_of, speed_of

    clock = clock_of(bandwidth, device, main_step_ms, draft_step_ms)
    if context is not None and context < 1:
        raise InputError(f"--context {context}: a context length of 1 token or more.")
    if engine is not None and vllm_depth(engine) not in (None, k):
        raise InputError(f"--engine-log {engine_log}: the vLLM run drafted k={vllm_depth(engine)} per round "
                        f"({vllm_depth(engine)} per-position rates) but --k is {k}; rerun accept with --k "
                        f"{vllm_depth(engine)}.")
    if main_model:  # a head-only checkpoint: said now, not after torch loads
        from oracle.checkpoint import Checkpoint

        Checkpoint(checkpoint).check_main_model("--hidden FILE (H from your engine) or --hidden-seed N "
                                                "(synthetic H; then --target text)")
    log = (lambda msg: None) if quiet else say
    log("loading torch and transformers …")
    from oracle.accept import measure_acceptance  # torch: only once the arguments are known to be usable
    from oracle.accept_report import engine_verdict, compare_engine, render_report, summary_line, write_json
    from oracle.accept_report import write_plot
    with reporting(enabled=not quiet):
        result = measure_acceptance(checkpoint, ids, HiddenSource(file=hidden_file, seed=hidden_seed,
                                    main_model=main_model), k=k, target=target, chunk_rows=chunk_rows, log=log,
                                    quantize=specs, settings=settings)
    speed = None if clock is None else speed_of(result, checkpoint, clock, context)
    click.echo(render_report(result, engine, speed))
    if json_out is not None:
        write_json(result, json_out, command=obj["command"], engine=engine, speed=speed)
        click.echo(f"wrote --json {json_out}")
    if plot is not None:
        write_plot(result, plot, speed)
        click.echo(f"wrote --plot {plot}")
    click.echo(summary_line(result, engine, speed))
    if engine is not None:
        verdict = engine_verdict(compare_engine(result, engine))
        if verdict != "pass":
            click.get_current_context().exit(1 if verdict == "diverged" else 3)


@cli.command(epilog="""\b
Examples:
  mtp-oracle noise fixtures/qwen3_5_tiny --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0 --out noise.json
  mtp-oracle noise CHECKPOINT --tokens-file steps.txt --hidden H.npy --out noise.json --margin 8 --paths bfloat16
  mtp-probe diff ref.h5 dump/ --profile noise.json:bfloat16
""")
@click.argument("checkpoint", type=CHECKPOINT)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Profile to write (JSON).")
@step_input_options("the reference trace's, for its noise")
@click.option("--margin", type=float, default=4.0, show_default=True,
              help="Tolerance = margin x the measured noise (>= 1).")
@click.option("--paths", default="float32,bfloat16,float16", show_default=True,
              help="Computation paths to measure against the float64 truth, comma separated.")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
@click.pass_obj
def noise(obj, checkpoint, out, tokens, tokens_file, hidden_file, hidden_seed, main_model, first_token, start_pos,
          margin, paths, quiet) -> None:
    """Measure each stage's rounding noise (float32, bf16, fp16 against float64) and write a tolerance profile."""
    from oracle.export import HiddenSource
    from oracle.inputs import token_ids_from_file, token_ids_from_text

    _exactly_one({"--tokens": tokens, "--tokens-file": tokens_file})
    _exactly_one({"--hidden": hidden_file, "--hidden-seed": hidden_seed, "--main-model": main_model or None})
    _refuse_overwriting_inputs({"--out": out}, checkpoint, tokens_file, hidden_file)
    check_writable(out, "--out")  # before the work, not after it
    ids = token_ids_from_file(tokens_file) if tokens_file else token_ids_from_text(tokens, "--tokens")
    source = HiddenSource(file=hidden_file, seed=hidden_seed, main_model=main_model, first_token=first_token)
    from oracle.noise import measure_noise, write_profile  # torch: once the arguments are known to be usable

    chosen = tuple(p.strip() for p in paths.split(","))
    with reporting(enabled=not quiet):
        profile = measure_noise(checkpoint, ids, source, start_pos=start_pos, paths=chosen, margin=margin,
                                command=obj["command"], log=(lambda msg: None) if quiet else say)
    write_profile(profile, out)
    click.echo(f"wrote {out}: {', '.join(profile['paths'])} against float64, margin {margin:g}, "
               f"T={profile['inputs']['num_tokens']}")


@cli.command(epilog="""\b
Examples:
  mtp-oracle inspect ref.h5
  mtp-oracle inspect fixtures/qwen3_5_tiny_ref.h5 | grep -A 20 'stages (in order'
""")
@click.argument("trace", type=EXISTING_FILE)
def inspect(trace) -> None:
    """Print a trace's schema, provenance, inputs and per-stage statistics."""
    from oracle.inspect import render_inspection

    click.echo(render_inspection(trace))


@cli.command()
@click.argument("ref", type=EXISTING_FILE)
@click.option("--out-dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write inputs.json, hidden.bin and embed.bin into (created if missing).")
def inputs(ref, out_dir) -> None:
    """Write REF's step inputs as the raw files an engine harness reads (for engines that dump their stages).

    \b
    Examples:
      mtp-oracle inputs ref.h5 --out-dir engine_inputs
      my_engine --inputs engine_inputs --dump dump && cp engine_inputs/{inputs.json,hidden.bin} dump/ \\
          && mtp-probe diff ref.h5 dump
    """
    from oracle.dump_inputs import INPUT_FILES, dump_inputs, shapes_text
    from oracle.output import declare_outputs

    declare_outputs(*(out_dir / name for name in INPUT_FILES))  # put in place together, when the command ends
    written = dump_inputs(ref, out_dir)
    click.echo(f"wrote {', '.join(str(p) for p in written)}: step i reads token_ids[i], positions[i], row i of "
               f"hidden.bin and embed.bin (little-endian float32, {shapes_text(ref)}). Dump the stages to another "
               f"directory (<stage>.bin); copy inputs.json and hidden.bin beside them so the probe checks them.")


@cli.command(epilog="""\b
Examples:
  mtp-oracle gguf fixtures/qwen3_5_tiny --out head.gguf
  mtp-oracle gguf CHECKPOINT --out head-q8.gguf --outtype q8_0
  mtp-probe run ref.h5 --impl llama.cpp:head.gguf""")
@click.argument("checkpoint", type=EXISTING_DIR)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="GGUF file to write.")
@click.option("--outtype", type=click.Choice(["f32", "bf16", "q8_0"]), default="f32", show_default=True,
              help="Type of the matrices (norms stay F32, as llama.cpp stores them).")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
def gguf(checkpoint, out, outtype, quiet) -> None:
    """Write CHECKPOINT's MTP head as the GGUF llama.cpp's MTP context loads (names blk.N.nextn.* and the block's
    attn_*/ffn_*, (1+w) norms stored as 1 + w, the metadata its loader reads; N = num_hidden_layers).

    The file holds the head, the embedding, the final norm and lm_head (an MTP-only GGUF, as llama.cpp's converter
    writes with --mtp-only); `mtp-oracle export` reads it back."""
    from oracle.gguf_writer import write_head_gguf

    refuse_overwriting_inputs({"--out": out}, {"checkpoint": checkpoint})
    check_writable(out)
    with reporting(enabled=not quiet):
        written = write_head_gguf(checkpoint, out, outtype, log=(lambda msg: None) if quiet else say)
    click.echo(f"wrote {written} ({outtype}): run it with `mtp-probe run REF --impl llama.cpp:{written}`")


def _refuse_overwriting_inputs(outputs: dict, checkpoint: Path, tokens_file: Path | None,
                               hidden_file: str | None, others: dict | None = None) -> None:
    from oracle.gguf_source import cache_files, gguf_file
    from oracle.inputs import hidden_file_path

    gguf = gguf_file(Path(checkpoint))  # a GGUF also reads the config.json beside it and its dequantized cache
    beside = {} if gguf is None else {"config.json beside the GGUF": gguf.parent / "config.json",
                                      "GGUF's dequantized cache": cache_files(Path(checkpoint))}
    refuse_overwriting_inputs(outputs, {"checkpoint": checkpoint, "--tokens-file": tokens_file,
                                        "--hidden file": hidden_file and hidden_file_path(hidden_file)} | beside
                              | (others or {}))


def _exactly_one(options: dict) -> None:
    given = [name for name, value in options.items() if value is not None]
    if len(given) != 1:
        raise click.UsageError(f"give exactly one of {', '.join(options)} (got {', '.join(given) or 'none'}).")


def main(args=None, standalone_mode: bool = True):
    # SIGTERM ends the process through Python, so an export in progress removes its temporary file.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    command = shlex.join(["mtp-oracle", *(sys.argv[1:] if args is None else args)])  # recorded in provenance
    return cli.main(args=args, prog_name="mtp-oracle", standalone_mode=standalone_mode, obj={"command": command})
