"""`mtp-oracle noise`: how far rounding alone moves each stage, measured, written as a tolerance profile.

What it is: the family's own head (`head_module(family).build_head`, the official modules the export runs) on one
set of inputs, run in float64 as the truth and again in each computation path:

    float32    the oracle's own precision: exactly the computation `mtp-oracle export` runs
    bfloat16   weights and activations cast to bf16, as an engine running bf16 holds them
    float16    likewise in fp16

Per stage and path: measured_max_rel = the worst per-row max|a-e| / max|e| (the probe's max_rel, a = path, e =
truth) and measured_max_abs = the worst per-row max|a-e|. The profile's tolerances, used by `mtp-probe diff
--profile FILE[:PATH]`:

    rtol = margin x max(measured_max_rel, u)   u = the path's unit roundoff: one rounding of the stage's own output,
                                               which any engine computing the stage in that dtype makes (a stage
                                               measured at 0 is therefore never made exact-only)
    atol = rtol x min_row_scale                the absolute error rtol already allows on the stage's smallest
                                               measured row (max|e|): atol decides only rows smaller than any
                                               measured, and never passes a measured-size row that rtol fails

What it is not: float64 everywhere. Where transformers pins an op to float32 inside an official module (RMSNorm's
variance, the eager softmax, the RoPE tables), the truth keeps that op in float32, so the float32 path's figures are
lower bounds at the stages it decides (the dense Qwen3.5 fixture measures e and h at exactly 0); the floor u covers
them. Nor is it an engine: a real bf16 engine fuses and accumulates differently, which is what the margin is for.
A MoE path whose top-k selection differs from the truth's at a token (a near-tie flipped by rounding) has that
token's rows after the selection left out of its figures; the tokens are recorded (`routing_flips`).
"""

import datetime
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint, check_token_ids
from oracle.errors import CheckpointError, InputError
from oracle.families.registry import head_module
from oracle.inputs import positions_from_start, token_ids_from_array
from oracle.limits import check_export_limits
from oracle.output import atomic_output
from oracle.stages import DRAFT, INDEX_SET, StageList
from oracle.trace import TraceInputs, inputs_digest

SCHEMA = "mtp-noise-profile/1"
PATHS = ("float32", "bfloat16", "float16")
DEFAULT_MARGIN = 4.0
# unit roundoff 2^-p of each path's dtype (p = significant bits: 24, 8, 11)
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
TRUTH = ("float64: the official modules with float64 weights and activations; transformers keeps RMSNorm's "
         "variance, the eager softmax and the RoPE tables in float32 inside them")
RULE = ("rtol = margin x max(measured_max_rel, unit_roundoff); atol = rtol x min_row_scale (the smallest measured "
        "row's max|e|); measured_max_rel = worst per-row max|a-e| / max|e| against the float64 truth")


def measure_noise(checkpoint: Path, token_ids: np.ndarray, hidden, start_pos: int = 0,
                  paths: tuple[str, ...] = PATHS, margin: float = DEFAULT_MARGIN, command: str = "",
                  log: Callable[[str], None] = lambda msg: None) -> dict:
    """The noise profile (a JSON-ready dict, schema `mtp-noise-profile/1`) of the head in `checkpoint` on these
    inputs (`hidden`: an oracle.export.HiddenSource)."""
    from oracle.export import _resolve_hidden  # the export's own H: a file, a seed or the main model

    _check_request(paths, margin)
    token_ids = token_ids_from_array(token_ids, "token_ids")
    ckpt = Checkpoint(checkpoint)
    cfg, family = ckpt.config, ckpt.family
    check_token_ids(token_ids, cfg.vocab_size)
    check_export_limits(cfg, len(token_ids), start_pos, "batched")
    log(f"checkpoint {ckpt.path}: family {family.name}, T={len(token_ids)}")
    h = _resolve_hidden(ckpt, hidden, token_ids, start_pos, log)
    impl = head_module(family)
    embed = impl.embedding_rows(ckpt, token_ids)[0] if hasattr(impl, "embedding_rows") else \
        ckpt.embedding_rows(token_ids)
    inputs = TraceInputs(token_ids, positions_from_start(len(token_ids), start_pos), h, embed)
    stage_list, projection = family.stages(cfg), _draft_projection(ckpt)
    if projection is None:  # as the export: no draft stage without the draft projection
        stage_list = StageList(s for s in stage_list if s.name != DRAFT.name)
    weights = ckpt.read_head(widen=False, digest=False)
    run = _Runner(impl, cfg, weights, inputs, tuple(n for n in stage_list.names if n != DRAFT.name), projection)
    log("running the head in float64 (the truth)")
    truth = run("float64")
    measured = {}
    for path in paths:
        log(f"running the head in {path}")
        measured[path] = _path_figures(truth, run(path), stage_list, path, margin)
    return {"schema": SCHEMA, "family": family.name, "checkpoint": str(Path(ckpt.path).resolve()),
            "checkpoint_digest": ckpt.head_digest(), "source": ckpt.source,
            "inputs": {"num_tokens": inputs.num_tokens, "start_pos": int(start_pos), "hidden": hidden.describe(),
                       "inputs_digest": inputs_digest(inputs)},
            "margin": float(margin), "truth": TRUTH, "rule": RULE, "stages": list(stage_list.names),
            "paths": measured, "command": command,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_profile(profile: dict, out: Path) -> Path:
    """Write the profile as JSON, atomically (a temporary name, renamed when complete), with its digest."""
    profile = profile | {DIGEST_KEY: profile_digest(profile)}
    with atomic_output(out, "--out") as tmp:
        tmp.write_text(json.dumps(profile, indent=1, allow_nan=False) + "\n")
    return Path(out)


DIGEST_KEY = "profile_digest"


def profile_digest(profile: dict) -> str:
    """"sha256:<hex>" of the profile's canonical JSON (sorted keys, no spaces) without its own digest. A profile sets
    what passes: the probe refuses one whose figures, margin or tolerances were edited after it was measured (an
    edit that kept them consistent with each other had passed a candidate 30% off at attn), as it refuses edited
    evidence. Unkeyed, like every digest here: it catches damage and careless edits, not a forger."""
    body = {key: value for key, value in profile.items() if key != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, allow_nan=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _check_request(paths: tuple[str, ...], margin: float) -> None:
    unknown = [p for p in paths if p not in PATHS]
    if not paths or unknown or len(set(paths)) != len(paths):
        raise InputError(f"--paths {','.join(paths)}: give one or more of {', '.join(PATHS)}, each once.")
    if not (np.isfinite(margin) and margin >= 1):
        raise InputError(f"--margin {margin}: the margin multiplies the measured noise and must be a finite number "
                         f">= 1 (below 1 a correct candidate of that precision would fail).")


class _Runner:
    """Builds the head afresh for each computation path and runs the T steps as one batched pass."""

    def __init__(self, impl, cfg, weights, inputs: TraceInputs, names: tuple[str, ...], projection=None):
        self.impl, self.cfg, self.weights, self.inputs, self.names = impl, cfg, weights, inputs, names
        self.projection = projection  # the draft projection (oracle/lm_head.py LmHead), or None: no draft stage

    def __call__(self, path: str) -> dict[str, np.ndarray]:
        import torch

        head, rotary = self.impl.build_head(self.cfg, self.impl.torch_weights(self.weights))
        if path != "float32":  # float32 is the export's own computation, untouched
            _compute_in(head, getattr(torch, path))
        stages = self.impl.run_batched(head, rotary, self.inputs)
        got = {name: stages[name] for name in self.names}  # evidence (e.g. topk_margin) is not measured
        if self.projection is not None:  # the draft of this path's out (float64 truth rows rounded to float32)
            got[DRAFT.name] = self.projection.argmax(np.asarray(got["out"], dtype=np.float32))[:, None]
        return got


def _draft_projection(ckpt: Checkpoint):
    """The family's draft projection, or None where the checkpoint lacks it (oracle/draft_loop.py)."""
    from oracle.draft_loop import draft_projection

    try:
        return draft_projection(ckpt)
    except CheckpointError:
        return None


def _compute_in(head, dtype) -> None:
    """Run `head` in `dtype`: its parameters and buffers cast (the linears and routed experts that widen stored
    weights follow their input's dtype), every floating input of its forward (embedding, hidden, RoPE tables,
    mask) cast on the way in, and every floating stage widened to float64 on the way out (numpy has no bf16)."""
    import torch

    def cast(value):
        if isinstance(value, tuple):
            return tuple(cast(v) for v in value)
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    head.to(dtype)
    head.register_forward_pre_hook(lambda module, args: cast(args))
    head.register_forward_hook(lambda module, args, out: {
        k: v.double() if v.is_floating_point() else v for k, v in out.items()})


def _path_figures(truth: dict, got: dict, stage_list, path: str, margin: float) -> dict:
    """One path's figures: per stage measured_max_rel/abs and the tolerance, tokens whose routing flipped."""
    flips = np.zeros(len(next(iter(truth.values()))), dtype=bool)
    stages = {}
    if "topk_ids" in truth and "topk_weights" in truth:  # as the probe compares them: in the truth's id order
        got = got | {"topk_weights": _in_id_order(got["topk_weights"], got["topk_ids"], truth["topk_ids"])}
    for stage in stage_list:
        e, a = truth[stage.name], got[stage.name]
        if stage.kind == INDEX_SET:  # compared as sets by the probe: no float tolerance
            flipped = ~(np.sort(a, axis=1) == np.sort(e, axis=1)).all(axis=1)
            stages[stage.name] = {"kind": INDEX_SET, "flipped_tokens": np.flatnonzero(flipped).tolist()}
            if stage.name != DRAFT.name:  # a draft flip (last stage) is no routing flip
                flips |= flipped
            continue
        stages[stage.name] = _stage_figures(a[~flips], e[~flips], path, margin)
    return {"unit_roundoff": UNIT_ROUNDOFF[path], "routing_flips": np.flatnonzero(flips).tolist(), "stages": stages}


def _in_id_order(weights: np.ndarray, ids: np.ndarray, truth_ids: np.ndarray) -> np.ndarray:
    """A path's topk_weights rows reordered into the truth's topk_ids order where both select the same experts:
    the probe compares a candidate's weights so (probe/diff.py _aligned_to_reference_ids), so a rank swap of two
    near-equal experts by rounding is no error there, and must not inflate the measured noise either (it made the
    measured topk_weights rtol reach 0.6-1.2 on DeepSeek heads: a stage that then checked nothing)."""
    out = np.array(weights, copy=True)
    for row, (mine, theirs) in enumerate(zip(np.asarray(ids), np.asarray(truth_ids))):
        if not np.array_equal(mine, theirs) and np.array_equal(np.sort(mine), np.sort(theirs)):
            where = {int(e): j for j, e in enumerate(mine)}
            out[row] = weights[row, [where[int(e)] for e in theirs]]
    return out


def _stage_figures(actual: np.ndarray, expected: np.ndarray, path: str, margin: float) -> dict:
    """measured_max_rel/abs of one stage's rows and the tolerance the rule derives from them."""
    d = np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max(axis=1)  # (T, w) -> (T,)
    scale = np.abs(expected.astype(np.float64)).max(axis=1)
    if not np.isfinite(actual).all():
        return {"kind": "rows", "nonfinite_rows": int((~np.isfinite(actual)).any(axis=1).sum()),
                "measured_max_rel": None, "measured_max_abs": None, "rtol": None, "atol": None}
    nonzero = scale > 0
    rel = float((d[nonzero] / scale[nonzero]).max()) if nonzero.any() else 0.0
    min_scale = float(scale[nonzero].min()) if nonzero.any() else 0.0
    rtol = margin * max(rel, UNIT_ROUNDOFF[path])
    # an all-zero truth row can only pass on atol: it gets at least margin x the noise measured on such rows
    atol = max(rtol * min_scale, margin * float(d[~nonzero].max()) if (~nonzero).any() else 0.0)
    return {"kind": "rows", "measured_max_rel": rel, "measured_max_abs": float(d.max()) if d.size else 0.0,
            "min_row_scale": min_scale, "rtol": rtol, "atol": atol}

