"""Acceptance of an MTP head for speculative decoding: conditional α_j and the chain-break E[accepted length].

A head that matches the reference stage by stage is correctly transcribed; whether it is useful is measured here.
Inputs: a sequence x_0..x_{N-1} and the main model's hidden H_0..H_{N-1} the head reads (post-final-norm; the
last block's hc streams for DeepSeek-V4). Bridge step i is (x_{i+1}, H_i, position i), the step a trace records.
After every bridge step i with i+1+k <= N-1 the head drafts a chain: draft 1 = argmax lm_head(out of bridge step
i); draft j >= 2 from (embedding of draft j-1, the head's own previous recycled hidden, position i+j-1): `out`, or
the stage its family names (FamilySpec.recycled; DeepSeek-V4: the block's output streams). Draft j of chain i
stands for x_{i+1+j}. The head's KV cache holds bridge steps 0..i; a chain's own entries are dropped after it, as
an engine rolls back rejected drafts. A family with a sliding window (FamilySpec.attention_window) has every query
see only the keys within W positions, itself included, as its stepwise window cache would hold them.

In deployment draft j is only checked when drafts 1..j-1 were accepted, so α_j is conditional and
E[len] = 1 + Σ_j Π_{m<=j} α_m; the naive 1 + Σ_j p_j of unconditional hit rates is an upper bound.
Both targets are teacher-forced on x: `greedy` (the main model's argmax, lm_head(H)) is exactly what greedy
verification checks only when x is the main model's own greedy output; `text` (x itself) is a proxy.

The cost is the lm_head (real scale 248320 x 5120): one sweep per depth for all chains together, the argmax of the
exact logits found by a bf16 screen under a proven bound and an exact rescoring of the survivors (oracle/lm_head.py).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from oracle.accept_conventions import Settings
from oracle.checkpoint import Checkpoint, check_token_ids
from oracle.draft_distributions import DraftStats, draft_stats, replayed_out_rows
from oracle.draft_loop import ARGMAX, CHAIN_BLOCK, ChainSpec, Head, bridge_pass, draft_projection, run_chains
from oracle.draft_loop import embedding_rows as _embedding_rows
from oracle.errors import CheckpointError, InputError
from oracle.export import HiddenSource, quiet_kernel_fallbacks
from oracle.fp8 import dequantize
from oracle.families.registry import head_module
from oracle.inputs import hidden_from_file, hidden_from_seed, token_ids_from_array
from oracle.limits import check_accept_memory
from oracle.lm_head import CHUNK_ROWS, LmHead, lm_head_of
from oracle.progress import Progress
from oracle.quantize_sim import QuantizedHead, QuantSpec, quantize_tensor
from oracle.quantize_sim import plan as quantization_plan

TARGETS = ("greedy", "text")
Rotary = torch.nn.Module


@dataclass(frozen=True)
class AcceptMetrics:
    """Per-depth counts over the chains; every rate derives from them."""

    chains: int
    hits: tuple[int, ...]  # chains whose draft j is right (p_j's numerator)
    runs: tuple[int, ...]  # chains whose drafts 1..j are all right (α_j's numerator)

    @property
    def k(self) -> int:
        return len(self.hits)

    @property
    def p(self) -> tuple[float, ...]:
        return tuple(h / self.chains for h in self.hits)

    @property
    def alpha_den(self) -> tuple[int, ...]:
        """α_j's denominator: chains whose drafts 1..j-1 are all right (all chains for j = 1)."""
        return (self.chains, *self.runs[:-1])

    @property
    def alpha(self) -> tuple[float | None, ...]:
        """α_j = P(draft j right | drafts 1..j-1 right); None where no chain got that far."""
        return tuple(n / d if d else None for n, d in zip(self.runs, self.alpha_den))

    @property
    def e_len(self) -> float:
        """1 + Σ_j Π_{m<=j} α_m, in exact fractions; an undefined α_j ends the sum (its term is 0 anyway)."""
        total, product = Fraction(1), Fraction(1)
        for num, den in zip(self.runs, self.alpha_den):
            if den == 0:
                break
            product *= Fraction(num, den)
            total += product
        return float(total)

    @property
    def e_len_naive(self) -> float:
        """1 + Σ_j p_j: an upper bound on E[len], blind to the conjunction of the earlier drafts."""
        return float(1 + Fraction(sum(self.hits), self.chains))


def acceptance_metrics(drafts: np.ndarray, targets: np.ndarray) -> AcceptMetrics:
    """Counts behind p_j and α_j from [chains, k] tables of drafted and target token ids."""
    if drafts.shape != targets.shape or drafts.ndim != 2 or drafts.size == 0:
        raise ValueError(f"drafts {drafts.shape} and targets {targets.shape} must be the same non-empty [C, k]")
    right = drafts == targets  # (C, k)
    runs = np.logical_and.accumulate(right, axis=1)  # (C, k): drafts 1..j all right
    return AcceptMetrics(chains=len(right), hits=tuple(int(v) for v in right.sum(axis=0)),
                         runs=tuple(int(v) for v in runs.sum(axis=0)))


def draft_chains(ckpt: Checkpoint, head: Head, rotary: Rotary, sequence: np.ndarray, hidden: np.ndarray, k: int,
                 chunk_rows: int = CHUNK_ROWS, chain_block: int = CHAIN_BLOCK,
                 also_score: np.ndarray | None = None,
                 on_depth: Callable[[int], None] = lambda drafts: None) -> tuple[np.ndarray, np.ndarray]:
    """Drafts [C, k], C = N-1-k: row i is the chain drafted after bridge step i (oracle/draft_loop.py, its own
    argmax fed back); and the lm_head argmax of the `also_score` rows [R, D], which ride along the first
    vocabulary sweep (empty when not given)."""
    lm_head = draft_projection(ckpt, chunk_rows)
    chains = len(sequence) - 1 - k
    window = ckpt.family.attention_window(ckpt.config)
    bridge = bridge_pass(head, rotary, _embedding_rows(ckpt, sequence[1:chains + 1]), hidden[:chains],
                         np.arange(chains), window)
    extra = [] if also_score is None else [np.asarray(also_score, dtype=np.float32)]
    scored = lm_head.argmax(np.concatenate([bridge.stages["out"].numpy(), *extra]))
    on_depth(chains)
    drafts = np.empty((chains, k), dtype=np.int64)
    drafts[:, 0] = scored[:chains]
    # token_ids: the teacher-forced tokens an N-layer head's layer caches hold (one-layer heads never read them)
    spec = ChainSpec(depths=k, rows=lambda depth: chains, tokens=ARGMAX, token_ids=np.asarray(sequence[1:]),
                     recycle=ckpt.family.recycled, window=window, keep=("out",), chain_block=chain_block)
    for depth in run_chains(head, rotary, bridge, spec, lambda ids: _embedding_rows(ckpt, ids),
                            draft=lambda rows: (lm_head.argmax(rows), None), first_drafts=drafts[:, 0]):
        drafts[:, depth.depth - 1] = depth.drafts
        on_depth(chains)
    return drafts, scored[chains:]


def target_table(sequence: np.ndarray, main_argmax: np.ndarray | None, k: int, target: str) -> np.ndarray:
    """Targets [C, k] for draft j of chain i: x_{i+1+j} (text) or argmax lm_head(H_{i+j}) (greedy).

    `main_argmax[m]` is the main model's argmax after x_0..x_{m+1}, i.e. of lm_head(H_{m+1})."""
    chains = len(sequence) - 1 - k
    at = np.arange(chains)[:, None] + np.arange(1, k + 1)[None, :]  # (C, k): i + j
    return sequence[at + 1] if target == "text" else main_argmax[at - 1]


@dataclass(frozen=True)
class QuantizeComparison:
    """With `quantize`: what was quantized, and the unquantized head's run on the same chains, H and targets."""

    head: QuantizedHead
    baseline: AcceptMetrics
    baseline_drafts: np.ndarray  # [C, k]


@dataclass(frozen=True)
class AcceptResult:
    metrics: AcceptMetrics  # of the head measured: the quantized one when `quantize` is set
    target: str
    sequence: np.ndarray  # x_0..x_{N-1}
    drafts: np.ndarray  # [C, k]; row r is the chain drafted after bridge step positions[r]
    targets: np.ndarray  # [C, k]
    source: dict  # checkpoint, hidden source, lm_head tensor
    quantize: QuantizeComparison | None = None
    settings: Settings | None = None  # p_min, temperature, position range (oracle/accept_conventions.py)
    stats: DraftStats | None = None  # the gate's confidence and sampled acceptance per draft, where asked
    positions: np.ndarray | None = None  # (C,): each chain's bridge step; None: 0..C-1
    layers: tuple[int, ...] = ()  # the physical MTP layer each depth ran (empty: layer 0 at every depth)

    @property
    def depth_layers(self) -> tuple[int, ...]:
        """The MTP layer of depths 1..k: j-1 on an N-layer head (transformers' MtpModel), else 0."""
        return self.layers or (0,) * self.metrics.k

    @property
    def chain_positions(self) -> np.ndarray:
        return np.arange(len(self.drafts)) if self.positions is None else self.positions


def measure_acceptance(checkpoint_dir: Path, sequence: np.ndarray, hidden: HiddenSource, k: int = 4,
                       target: str | None = None, head_weights: dict[str, np.ndarray] | None = None,
                       chunk_rows: int = CHUNK_ROWS, log: Callable[[str], None] = lambda msg: None,
                       quantize: tuple[QuantSpec, ...] = (), settings: Settings | None = None) -> AcceptResult:
    """Draft a k-chain after every bridge step of `sequence` and score the chains against `target`.

    `target` None means greedy, or text when H is synthetic (`hidden.seed`). `head_weights` replaces the
    checkpoint's `mtp.*` tensors (e.g. a random head as a baseline). `quantize` (oracle/quantize_sim.py) measures
    the head with those tensors quantized, beside the unquantized head on the same chains (result.quantize).
    `settings` (oracle/accept_conventions.py): the p_min gate and sampled verification need the exact
    distributions per draft (oracle/draft_distributions.py); a position range keeps those chains only.

    The drafts come from the head's own output projection (draft_loop.draft_projection: the MTP layer's `shared_head.head` where
    its family has one); greedy targets and the verifier's distribution from the main model's lm_head."""
    sequence = token_ids_from_array(sequence, "sequence")
    _check_k(k, len(sequence))
    settings = Settings(k=k) if settings is None else settings
    ckpt = Checkpoint(checkpoint_dir)
    layers = _depth_layers(ckpt, k)
    check_token_ids(sequence, ckpt.config.vocab_size)
    check_accept_memory(ckpt.config, len(sequence), k)  # the bridge pass is quadratic in N (oracle/limits.py)
    lm_head = draft_projection(ckpt, chunk_rows)
    target = _resolved_target(target, hidden)
    _check_settings(settings, k, len(sequence), hidden)
    main_head = _main_lm_head(ckpt, chunk_rows, lm_head) if target == "greedy" or settings.temperature else None
    rides_along = target == "greedy" and main_head.name == lm_head.name  # one sweep scores drafts and targets
    quantized = _quantized_head(ckpt, head_weights, quantize) if quantize else None  # bad globs before H's run
    h = _hidden_of(ckpt, hidden, sequence, log)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, _head_tensors(ckpt, head_weights))
    chains = len(sequence) - 1 - k
    log(f"drafting {chains} chains of k={k} (N={len(sequence)} tokens); lm_head {lm_head.name} in chunks of "
        f"{chunk_rows} rows")
    main_rows = _lm_head_input(ckpt, h) if main_head is not None else None  # (N, D): lm_head input at each m
    with Progress("accept", total=chains * k * (2 if quantized else 1), unit="draft") as bar:
        # greedy targets: the main model's own argmax at positions 1..N-2, riding along the first drafts' sweep
        # where the main lm_head is the head's own; else through the main lm_head itself
        drafts, main_argmax = draft_chains(ckpt, head, rotary, sequence, h, k, chunk_rows,
                                           also_score=main_rows[1:-1] if rides_along else None,
                                           on_depth=bar.update)
        if target == "greedy" and not rides_along:
            main_argmax = main_head.argmax(main_rows[1:-1])
        if quantized:  # the same chains, H and targets through the quantized head
            q_head, _ = impl.build_head(ckpt.config, quantized[0])
            q_drafts = draft_chains(ckpt, q_head, rotary, sequence, h, k, chunk_rows, on_depth=bar.update)[0]
    targets = target_table(sequence, main_argmax, k, target)
    source = {"checkpoint": str(ckpt.path), "hidden": hidden.describe(), "lm_head": lm_head.name,
              "target_lm_head": None if main_head is None else main_head.name,
              "head": "checkpoint mtp.*" if head_weights is None else "weights given by the caller"}
    measured = (q_head, q_drafts) if quantized else (head, drafts)
    stats = _draft_stats(ckpt, measured, rotary, sequence, h, lm_head, main_head, main_rows, settings, log)
    result = AcceptResult(acceptance_metrics(drafts, targets), target, sequence, drafts, targets, source,
                          settings=settings, stats=stats, layers=layers)
    if quantized:
        comparison = QuantizeComparison(quantized[1], result.metrics, drafts)
        source = source | {"head": f"{source['head']}, quantized: {' '.join(map(str, quantize))}"}
        result = replace(result, metrics=acceptance_metrics(q_drafts, targets), drafts=q_drafts, source=source,
                         quantize=comparison)
    ckpt.check_unchanged()  # a shard rewritten meanwhile: the drafts may mix old and new weights (as export refuses)
    return within_positions(result, settings.positions)


def _draft_stats(ckpt: Checkpoint, measured: tuple, rotary: Rotary, sequence: np.ndarray, h: np.ndarray,
                 lm_head: LmHead, main_head: LmHead | None, main_rows: np.ndarray | None, settings: Settings,
                 log: Callable[[str], None]) -> DraftStats | None:
    """The gate's confidence and sampled acceptance of the measured head's drafts, where the settings ask."""
    if settings.p_min is None and settings.temperature is None:
        return None
    head, drafts = measured
    log(f"replaying {len(drafts)} chains for the exact distributions of {drafts.size} drafts (float64 logits)")
    out_rows = replayed_out_rows(ckpt, head, rotary, sequence, h, drafts)
    with Progress("distributions", total=len(drafts), unit="chain") as bar:
        return draft_stats(lm_head, main_head, out_rows, main_rows, drafts, settings.p_min_top_k,
                           settings.temperature, settings.draft_sampling, on_block=bar.update)


def within_positions(result: AcceptResult, positions: tuple[int, int] | None) -> AcceptResult:
    """The chains whose bridge step lies in positions[0]..positions[1]-1 (all where None)."""
    if positions is None:
        return result
    first, last = positions
    keep = slice(first, min(last, len(result.drafts)))
    stats = result.stats
    if stats is not None:
        stats = DraftStats(stats.confidence[keep], stats.confidence_full[keep],
                           None if stats.beta is None else stats.beta[keep])
    quantize = result.quantize
    if quantize is not None:
        base = acceptance_metrics(quantize.baseline_drafts[keep], result.targets[keep])
        quantize = QuantizeComparison(quantize.head, base, quantize.baseline_drafts[keep])
    drafts, targets = result.drafts[keep], result.targets[keep]
    return replace(result, metrics=acceptance_metrics(drafts, targets), drafts=drafts, targets=targets, stats=stats,
                   quantize=quantize, positions=np.arange(len(result.drafts))[keep])


def _check_settings(settings: Settings, k: int, num_tokens: int, hidden: HiddenSource) -> None:
    if settings.k != k:
        raise InputError(f"settings.k={settings.k} differs from k={k}; pass one k.")
    if settings.p_min is not None and not 0 <= settings.p_min <= 1:
        raise InputError(f"--p-min {settings.p_min}: a probability in [0, 1] (llama.cpp's --spec-draft-p-min).")
    if settings.p_min_top_k < 0 or settings.n_min < 0:
        raise InputError(f"--p-min-top-k {settings.p_min_top_k} / --n-min {settings.n_min}: use 0 or more.")
    if settings.temperature is not None:
        if not (math.isfinite(settings.temperature) and settings.temperature > 0):
            raise InputError(f"--temperature {settings.temperature}: sampled verification needs a finite "
                             f"temperature > 0 (leave it out for greedy verification).")
        if hidden.seed is not None:
            raise InputError("--temperature verifies against the main model's distribution, softmax(lm_head(H)); "
                             "with --hidden-seed H is synthetic, so there is no main model. Pass --hidden FILE or "
                             "--main-model.")
    if settings.draft_sampling not in ("greedy", "sampled"):
        raise InputError(f"--draft-sampling {settings.draft_sampling!r}: use greedy or sampled.")
    if settings.buckets < 1:
        raise InputError(f"--buckets {settings.buckets}: use 1 or more.")
    chains = num_tokens - 1 - k
    if settings.positions is not None:
        first, last = settings.positions
        if not 0 <= first < last or first >= chains:
            raise InputError(f"--positions {first}:{last}: chains are drafted after bridge steps 0..{chains - 1} "
                             f"(N={num_tokens}, k={k}); give FIRST:LAST with 0 <= FIRST < LAST and FIRST <= "
                             f"{chains - 1}.")


def _main_lm_head(ckpt: Checkpoint, chunk_rows: int, own: LmHead) -> LmHead:
    """The main model's output projection, which scores greedy targets and gives the verifier's distribution:
    `lm_head.weight` (or the tied embedding); the family's own projection only where it is a main-model tensor
    (DeepSeek-V4's shared `head.weight`), never the MTP layer's copy (`shared_head.head`), which only drafts."""
    try:
        return lm_head_of(ckpt, chunk_rows)
    except CheckpointError as missing:
        if not own.name.startswith(ckpt.family.head_prefix.format(num_hidden_layers=getattr(
                ckpt.config, "num_hidden_layers", None))):
            return own
        raise CheckpointError(f"greedy targets and --temperature are scored with the main model's lm_head, not the "
                              f"MTP layer's own copy {own.name} (it drafts). {missing} Or use --target text.") from None


def _lm_head_input(ckpt: Checkpoint, hidden: np.ndarray) -> np.ndarray:
    """The main model's lm_head input for H rows (its greedy argmax): H itself, or what the family derives from it
    (DeepSeek-V4: the main model's hc_head collapse and final norm of the streams)."""
    impl = head_module(ckpt.family)
    return impl.main_lm_head_input(ckpt, hidden) if hasattr(impl, "main_lm_head_input") else hidden


def _head_tensors(ckpt: Checkpoint, given: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor]:
    if given is None:
        # digest=False: nothing here records the head digest, and its sha256 (850 MB at the 27B shape, ~0.57 s) was
        # a tenth of an in-process acceptance run
        return head_module(ckpt.family).torch_weights(ckpt.read_head(widen=False, digest=False))  # bf16 widened in use
    return {name: torch.from_numpy(np.asarray(arr, dtype=np.float32)) for name, arr in given.items()}


def _quantized_head(ckpt: Checkpoint, given: dict[str, np.ndarray] | None,
                    specs: tuple[QuantSpec, ...]) -> tuple[dict[str, torch.Tensor], QuantizedHead]:
    """The head's tensors with those `specs` match quantized and dequantized to float32 (oracle/quantize_sim.py),
    the rest as stored; and what was quantized at what error. One tensor at a time: only matched ones widen."""
    tensors = _head_tensors(ckpt, given)
    layout = ckpt.layout()
    scales = {_fp8_scale_name(tensors, n): n for n, t in tensors.items() if t.dtype == torch.uint8}
    not_simulated = {n: f"the block scale of {w}" for n, w in scales.items()}
    not_simulated |= {n: "a vocabulary table accept reads from the checkpoint itself"
                      for n in set(layout.shapes()) - set(layout.dense)
                      - set(layout.experts.shapes() if layout.experts else ())}
    chosen = quantization_plan(specs, {n: tuple(t.shape) for n, t in tensors.items()}, not_simulated)
    block = tuple(getattr(ckpt.config, "weight_block_size", None) or (128, 128))
    report = []
    for name, spec in chosen.items():
        value, cost = quantize_tensor(name, _float32_of(tensors, name, block), spec)
        if tensors[name].dtype == torch.uint8:  # its value is float32 now: its block scale must go with it
            del tensors[_fp8_scale_name(tensors, name)]
        tensors[name] = torch.from_numpy(value)
        report.append(cost)
    kept = tuple(n for n in tensors if n not in chosen)
    return tensors, QuantizedHead(tuple(specs), tuple(report), kept)


def _fp8_scale_name(tensors: dict[str, torch.Tensor], name: str) -> str:
    """The block scale beside an FP8 weight: `X.weight_scale_inv`, or `X.scale` where a release names it so."""
    stem = name.removesuffix("weight")
    return stem + "weight_scale_inv" if stem + "weight_scale_inv" in tensors else stem + "scale"


def _float32_of(tensors: dict[str, torch.Tensor], name: str, block: tuple[int, int]) -> np.ndarray:
    """A head tensor's value as float32: bf16/f16 widened (exact), FP8 dequantized with its block scale."""
    t = tensors[name]
    if t.dtype != torch.uint8:
        return t.float().numpy()
    scale = tensors.get(_fp8_scale_name(tensors, name))
    if scale is None:
        raise CheckpointError(f"{name} is F8_E4M3 without a block scale beside it ({_fp8_scale_name(tensors, name)}); "
                              f"the checkpoint is inconsistent.")
    return dequantize(t.numpy(), scale.float().numpy(), block, name)


def _depth_layers(ckpt: Checkpoint, k: int) -> tuple[int, ...]:
    """The MTP layer each depth 1..k runs: j-1 on an N-layer head (transformers' MtpModel), 0 on a one-layer head.
    k > N is refused here, before the main model runs: accept drafts depth j with layer j-1 only."""
    layers = ckpt.family.layer_count(ckpt.config)
    if layers == 1:
        return (0,) * k
    if k > layers:
        raise InputError(f"--k {k}: the {ckpt.family.name} head has {layers} MTP layers and depth j runs layer j-1 "
                         f"(transformers' MtpModel), so accept measures at most {layers} depths: use --k {layers} or "
                         f"less. (vLLM's layer (j-1) % N reuse is traced by export --chain-layers modulo; accept does "
                         f"not measure it.)")
    return tuple(range(k))


def _check_k(k: int, num_tokens: int) -> None:
    if k < 1:
        raise InputError(f"--k {k}: a chain has at least one draft; use --k 1 or more (the seed measured k=4).")
    if num_tokens < k + 2:
        raise InputError(f"the sequence has {num_tokens} tokens, too short for k={k}: the chain after bridge step "
                         f"i needs x_0..x_(i+1+k), so even one chain needs N >= k + 2 = {k + 2} tokens. Pass a "
                         f"longer --tokens/--tokens-file (about 100+ tokens for a useful estimate) or a smaller --k.")


def _resolved_target(target: str | None, hidden: HiddenSource) -> str:
    synthetic = hidden.seed is not None
    if target is None:
        return "text" if synthetic else "greedy"
    if target not in TARGETS:
        raise InputError(f"--target {target!r}: use one of {', '.join(TARGETS)}.")
    if target == "greedy" and synthetic:
        raise InputError("--target greedy compares each draft with the main model's own argmax, lm_head(H); with "
                         "--hidden-seed H is synthetic, so there is no main model to agree with. Pass the main "
                         "model's hidden (--hidden FILE or --main-model), or use --target text.")
    return target


def _hidden_of(ckpt: Checkpoint, source: HiddenSource, sequence: np.ndarray,
               log: Callable[[str], None]) -> np.ndarray:
    """H [N, w] for x_0..x_{N-1} (w = D, or hc·D streams for DeepSeek-V4): from a file, a seed, or the
    checkpoint's main model run over the sequence."""
    given = [source.file is not None, source.seed is not None, source.main_model]
    if sum(given) != 1 or source.first_token is not None:
        raise InputError("give exactly one of --hidden FILE, --hidden-seed N or --main-model (hidden=HiddenSource"
                         "(file=... | seed=... | main_model=True)); accept reads H for the whole sequence x_0.., so "
                         "first_token does not apply.")
    n, d = len(sequence), ckpt.family.hidden_width(ckpt.config)
    if source.file is not None:
        return hidden_from_file(source.file, n, d, d // ckpt.config.hidden_size)
    if source.seed is not None:
        return hidden_from_seed(source.seed, n, d)
    ckpt.check_main_model("--hidden FILE (H from your engine) or --hidden-seed N (synthetic H; then --target text)")
    log("running the main model over x_0..x_(N-1) for H")
    impl = head_module(ckpt.family)
    with quiet_kernel_fallbacks():
        return impl.main_model_hidden(impl.load_main_model(ckpt), sequence)
