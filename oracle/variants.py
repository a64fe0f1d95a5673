"""The oracle side of `mtp-probe --explain`, for every family: a head's stages as separate operators, its known
wiring variants, and the three measurements built on them (local error, diagnosis by fingerprint, weight coverage).

What it is: the `Explainer`, family-neutral. Each family's head module brings its operators and variants (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next: oracle/families/qwen3_5_explain.py; DeepSeek-V3, GLM-4.5:
oracle/families/mtp_layer_explain.py): `explain_ops(head, rotary, inputs, cfg)` computes each stage from its named
predecessor stages with the official modules of the head `build_head` loaded. Fed the oracle's own stages it
reproduces the trace (tests/probe/test_explain.py); fed a candidate's stages it says which stage the candidate
computed wrongly from its own inputs. A variant is the same head with ONE wiring change made by patching a copy of a
module or of a weight (never transformers' code; the copying helpers below are shared by the families' patches).
Variants share the oracle's pass up to the first stage they change, and a variant is abandoned at the first captured
stage where it does not reproduce the candidate (most are, within one stage), so diagnosis costs little more than
one pass.
What it is not: imported by the probe's normal paths (torch and transformers load only under --explain), or a
judge of tolerances: the probe passes `row_ok` (its own row rule) in.

Interface for a family: its head module may define `explain_ops(head, rotary, inputs, cfg) -> ops` (attributes
`order`, `uses`, `moe`, `num_tokens`, `compute(name, stages)`, `copy()`, `prefix(n)`; optional `owners` {tensor:
(path, leaf)} for coverage, `plain_norms` (w, not 1+w, norms), `qk_path`, and `checkpoint`, which the Explainer
fills with the reference's Checkpoint) and `EXPLAIN_VARIANTS: dict[name, (first_stage, patch(ops) -> ops | str)]`
(a string is the reason the variant cannot be checked on this trace). Without them, --explain reports local error
and diagnosis as unavailable for that family.
"""

import copy
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from oracle.families.torch_parts import UpcastLinear
from oracle.trace import TraceInputs

Tensor = torch.Tensor
RowOk = Callable[..., np.ndarray]  # (stage, actual, expected, ids=(actual ids, expected ids) | None) -> bool per row

# Coverage: an error of 1% of the tensor's RMS (of 1+w for a (1+w) norm) in every element. A linear's error is the
# rank-1 sign pattern eps·rms·s rᵀ (s, r random ±1): every element moves by exactly 1% of the RMS, and
# (W + δW) x = W x + eps·rms·s (r·x) costs one extra dot product instead of a second copy of the weight.
PERTURBATION = 1e-2
PREFIX = 16  # variants and perturbations are tried on the first PREFIX tokens first; most are settled there


def _identity_router(router: nn.Module) -> nn.Module:
    """A copy of the official router whose linear is the identity over E: its forward turns given router logits
    into the top-k selection and weights exactly as the real one turns its own (x @ I is exact)."""
    clone = copy.copy(router)
    clone._parameters = dict(router._parameters)
    e = router.weight.shape[0]
    clone.weight = nn.Parameter(torch.eye(e, dtype=router.weight.dtype), requires_grad=False)
    clone.hidden_dim = e
    return clone


# ---- copies of modules and weights, for the families' variant patches -------------------------------------

def _module_copy(module: nn.Module, **children) -> nn.Module:
    """A shallow copy of `module` with some child modules or parameters replaced (the original is untouched)."""
    clone = copy.copy(module)
    clone._modules, clone._parameters = dict(module._modules), dict(module._parameters)
    for name, value in children.items():
        setattr(clone, name, value)
    return clone


def _linear(weight: Tensor) -> UpcastLinear:
    return UpcastLinear(weight.contiguous())


def _weight(linear: nn.Module) -> Tensor:
    """A linear's weight as stored (bf16 stays bf16), or the whole float32 value of one over FP8 bytes (Fp8Linear:
    its `.weight` holds the bytes)."""
    return linear.value() if callable(getattr(linear, "value", None)) else linear.weight.detach()


# ---- building the head and the three measurements ------------------------------------------------------------

DRAFT = "draft"  # oracle/stages.py DRAFT: after `out`, the argmax of the draft projection (not an operator stage)


class Explainer:
    """The reference's head as per-stage operators over the reference's inputs, with its variants (and the draft
    of their `out`, where the candidate captured it)."""

    def __init__(self, checkpoint_dir, inputs: TraceInputs, conventions: dict | None = None,
                 expected_digest: str | None = None, reference: dict[str, np.ndarray] | None = None):
        import dataclasses

        from oracle.checkpoint import Checkpoint
        from oracle.errors import CheckpointError
        from oracle.families.registry import head_module

        ckpt = Checkpoint(checkpoint_dir)
        fields = {f.name for f in dataclasses.fields(ckpt.config)}
        cfg = dataclasses.replace(ckpt.config, **{k: v for k, v in (conventions or {}).items() if k in fields})
        weights = ckpt.read_head(widen=False)
        if expected_digest and weights.digest != expected_digest:
            raise CheckpointError(f"--explain: checkpoint {ckpt.path} holds head weights of digest {weights.digest}, "
                                  f"but the reference was exported from {expected_digest}; pass its checkpoint "
                                  f"(--checkpoint).")
        self.family = ckpt.family
        self.cfg = cfg
        impl = head_module(ckpt.family)
        self._impl, self._weights = impl, impl.torch_weights(weights)  # the loop variants rebuild the head from them
        self.head, self.rotary = impl.build_head(cfg, self._weights)
        self.inputs = inputs
        self.reference = reference  # the trace's own stages: the shared pass, already computed by the oracle
        self._checkpoint = ckpt  # the draft projection is read only where a candidate's draft is compared
        self.supported = hasattr(impl, "explain_ops")
        if not self.supported:
            self.ops, self.patches = None, {}
            return
        self.ops = impl.explain_ops(self.head, self.rotary, inputs, cfg)
        if hasattr(self.ops, "checkpoint"):  # variants that read a main-model tensor (e.g. model.norm.weight)
            self.ops.checkpoint = ckpt
        self.patches = getattr(impl, "EXPLAIN_VARIANTS", {})
        self._base: dict[str, Tensor] | None = None

    def loop_variants(self, info, chain_tokens=None):
        """The draft loop's variants (oracle/loop_variants.py) over the reference's inputs and chain record `info`
        (None: depth 1 only) and its recorded chain tokens {depth: ids}: every family, with or without the
        per-stage operators above."""
        from oracle.loop_variants import LoopVariants

        return LoopVariants(self._checkpoint, self.cfg, self._impl, self._weights, self.head, self.rotary,
                            self.inputs, info, chain_tokens)

    def draft(self, out: Tensor) -> np.ndarray | None:
        """The `draft` stage [n, 1] of these `out` rows: the exact argmax of the family's draft projection
        (oracle/draft_loop.py); None where the checkpoint has no projection."""
        from oracle.draft_loop import draft_projection
        from oracle.errors import CheckpointError

        try:
            projection = draft_projection(self._checkpoint)
        except CheckpointError:
            return None
        return projection.argmax(np.ascontiguousarray(out.numpy(), dtype=np.float32))[:, None]

    @property
    def base(self) -> dict[str, Tensor]:
        """The oracle's own stages through the operators (the shared pass every variant starts from)."""
        if self._base is None and self.reference is not None and all(n in self.reference for n in self.ops.order):
            self._base = {n: torch.from_numpy(np.ascontiguousarray(self.reference[n])) for n in self.ops.order}
        if self._base is None:
            s: dict[str, Tensor] = {}
            for name in self.ops.order:
                s[name] = self.ops.compute(name, s)
            self._base = s
        return self._base

    def local(self, cand: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, ...]]]:
        """Per stage: the stage recomputed with the oracle's operator from the candidate's OWN previous stages
        (attention: from its ah rows of every token), and the uncaptured stages that recomputation stood on.

        A stage the candidate did not capture has no value of the candidate's to read: its oracle recomputation
        stands in so the chain continues, but it is not the candidate's, so a later stage computed from it cannot
        be blamed alone. `upstream[stage]`: the uncaptured stages whose stand-ins reach `stage` (through
        uncaptured stages only; a captured stage is the candidate's own)."""
        s = _Reads()
        out: dict[str, np.ndarray] = {}
        upstream: dict[str, tuple[str, ...]] = {}
        for name in self.ops.order:
            s.read = set()
            value = self.ops.compute(name, s)
            reached = set()
            for dep in s.read - set(cand):
                reached |= {dep, *upstream.get(dep, ())}
            upstream[name] = tuple(n for n in self.ops.order if n in reached)
            out[name] = value.numpy()
            s[name] = torch.from_numpy(np.ascontiguousarray(cand[name])) if name in cand else value
        if DRAFT in cand:  # the candidate's own out through the right projection: a wrong matrix is local here
            drafted = self.draft(s["out"])
            if drafted is not None:
                out[DRAFT] = drafted
                upstream[DRAFT] = () if "out" in cand else ("out", *upstream.get("out", ()))
        return out, upstream

    def variants(self, names: tuple[str, ...], cand: dict[str, np.ndarray], row_ok: RowOk,
                 max_rel: Callable[[str, np.ndarray, np.ndarray], float]) -> list[dict]:
        """Each variant run stage by stage from the shared pass, compared with every captured stage of the
        candidate at every token; abandoned at the first stage it does not reproduce."""
        results = []
        for name in names:
            if name not in self.patches:
                results.append({"variant": name, "status": "not implemented", "reason":
                                f"no patch for {name} in this family's explain operators"})
                continue
            first, patch = self.patches[name]
            if first not in self.ops.order:
                results.append({"variant": name, "status": "not applicable", "reason": f"no {first} stage"})
                continue
            ops = patch(self.ops)
            if isinstance(ops, str):
                results.append({"variant": name, "status": "not checkable", "reason": ops})
                continue
            results.append(self._run_variant(name, ops, first, cand, row_ok, max_rel))
        return results

    def _run_variant(self, name, ops, first, cand, row_ok, max_rel) -> dict:
        """On the first PREFIX tokens, then (if it still reproduces the candidate) on all of them."""
        for n in sorted({min(PREFIX, self.ops.num_tokens), self.ops.num_tokens}):
            result = self._chain(name, ops.prefix(n), first, {k: v[:n] for k, v in cand.items()}, row_ok, max_rel, n)
            if result["status"] != "reproduces":
                break
        return result

    def _chain(self, name, ops, first, cand, row_ok, max_rel, n) -> dict:
        start = self.ops.order.index(first)
        s = {k: self.base[k][:n] for k in self.ops.order[:start]}
        matched, worst = [], 0.0
        for stage in self.ops.order:
            if stage not in s:
                s[stage] = ops.compute(stage, s)
            if stage not in cand:
                continue
            value = s[stage].numpy()
            ids = _ids(stage, cand, s)
            ok = row_ok(stage, cand[stage], value, ids=ids)
            rel = max_rel(stage, cand[stage], value, ids=ids)
            if not ok.all():
                return {"variant": name, "status": "differs", "first_mismatch": stage,
                        "token": int(np.flatnonzero(~ok)[0]), "max_rel": rel, "stages_matched": matched}
            matched.append(stage)
            worst = max(worst, rel)
        drafted = self.draft(s["out"]) if DRAFT in cand else None
        if drafted is not None:  # the variant's own draft: the argmax of its out
            ok = row_ok(DRAFT, cand[DRAFT], drafted)
            if not ok.all():
                return {"variant": name, "status": "differs", "first_mismatch": DRAFT,
                        "token": int(np.flatnonzero(~ok)[0]), "max_rel": worst, "stages_matched": matched}
            matched.append(DRAFT)
        return {"variant": name, "status": "reproduces", "max_rel": worst, "stages_matched": matched}

    def coverage(self, captured: tuple[str, ...], tokens: int, row_ok: RowOk, seed: int = 0) -> list[dict]:
        """Per head tensor: would an error of PERTURBATION x its RMS in every element have made one of the compared
        rows (captured stages, tokens < `tokens`) fail? Measured by rerunning from the stage that reads it."""
        results = []
        generator = torch.Generator().manual_seed(seed)
        owners = getattr(self.ops, "owners", {})  # a family's operators name their own owners
        for tensor, first in self.ops.uses.items():
            path = owners.get(tensor)
            if path is None:
                continue
            results.append({"tensor": tensor, **self._perturbed(first, path, captured, tokens, row_ok, generator)})
        return results

    def _perturbed(self, first, path, captured, tokens, row_ok, generator) -> dict:
        ops = self.ops.copy()
        owner_path, leaf = path
        original = _get(ops, owner_path + (leaf,))
        if isinstance(original, UpcastLinear) or callable(getattr(original, "value", None)):  # or over FP8 bytes
            replacement = _RankOneError(original, _rms(_weight(original)), generator)
        else:  # a norm's (1+w) (w for plain norms) or a router's [E, D] weight: perturbed element by element
            w = original.weight.detach()
            base = 1.0 + w.float() if w.dim() == 1 and not getattr(ops, "plain_norms", False) else w.float()
            noisy = w.float() + PERTURBATION * base.pow(2).mean().sqrt() * torch.randn(w.shape, generator=generator)
            replacement = _module_copy(original, weight=nn.Parameter(noisy, requires_grad=False))
        _set(ops, owner_path + (leaf,), replacement)
        start = ops.order.index(first)
        for n in sorted({min(PREFIX, tokens), tokens}):  # most errors show in the first PREFIX tokens
            part = ops.prefix(n)
            base = {k: v[:n] for k, v in self.base.items()}
            s = {k: base[k] for k in ops.order[:start]}
            for stage in ops.order[start:]:
                s[stage] = part.compute(stage, s)
                if stage not in captured:
                    continue
                ok = row_ok(stage, s[stage].numpy(), base[stage].numpy(), ids=_ids(stage, s, base))
                if not ok.all():
                    return {"evidenced": True, "first_seen": {"stage": stage, "token": int(np.flatnonzero(~ok)[0])}}
        return {"evidenced": False, "first_seen": None}

    def experts(self, ref_topk_ids: np.ndarray | None) -> dict | None:
        """For a MoE head: which routed experts these tokens route to (the rest could hide any error)."""
        if not self.ops.moe or ref_topk_ids is None:
            return None
        used = sorted(int(e) for e in np.unique(ref_topk_ids))
        total = int(self.ops.mlp.gate.weight.shape[0])
        return {"num_experts": total, "routed": used, "never_routed": sorted(set(range(total)) - set(used))}


class _Reads(dict):
    """Stages by name, recording which ones an operator reads (`read`): a stage's direct inputs."""

    read: set

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


class _RankOneError(nn.Module):
    """`linear` with weight W + eps·rms·s rᵀ, s and r random ±1 vectors: every element off by 1% of the RMS."""

    def __init__(self, linear: nn.Module, rms: float, generator: torch.Generator):
        super().__init__()
        out_features, in_features = linear.weight.shape
        self.linear, self.scale = linear, PERTURBATION * rms
        self.s = torch.randint(0, 2, (out_features,), generator=generator).float() * 2 - 1
        self.r = torch.randint(0, 2, (in_features,), generator=generator).float() * 2 - 1

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + (self.scale * (x @ self.r))[..., None] * self.s


def _ids(stage: str, actual: dict, expected: dict) -> tuple | None:
    """(actual's, expected's) topk_ids for a topk_weights comparison, which the probe's row rule makes in the
    expected side's id order (as its diff does); None for other stages or ids either side lacks."""
    if stage != "topk_weights":
        return None
    return tuple(np.asarray(side["topk_ids"]) if "topk_ids" in side else None for side in (actual, expected))


def _rms(weight: Tensor) -> float:
    """RMS of a stored weight, widened 256 rows at a time (no float32 copy of the whole tensor)."""
    total = 0.0
    for start in range(0, weight.shape[0], 256):
        total += float(weight[start:start + 256].float().pow(2).sum())
    return (total / weight.numel()) ** 0.5


def _get(ops, path: tuple[str, ...]):
    obj = getattr(ops, path[0])
    for name in path[1:]:
        obj = getattr(obj, name)
    return obj


def _set(ops, path: tuple[str, ...], value) -> None:
    """Replace the module at `path` on `ops` (a copy), copying each module on the way (originals untouched)."""
    if len(path) == 1:
        setattr(ops, path[0], value)
        return
    parents = [getattr(ops, path[0])]
    for name in path[1:-1]:
        parents.append(getattr(parents[-1], name))
    child = value
    for parent, name in reversed(list(zip(parents, path[1:]))):
        child = _module_copy(parent, **{name: child})
    setattr(ops, path[0], child)
