"""`--explain` on N-layer heads (issue 25): two layers' caches swapped, one shared_head for every layer.

Each buggy candidate is written by an engine of the test's own, never by the oracle's loop or its variants:
- `stepwise_engine`: the head's official layers (the oracle's build_head) driven one token at a time in the
  engine's order (bridge c on layer 0, then its chain: depth j on layer j-1), teacher-forced, each layer's K/V
  entries stored in a list per layer and handed back through a transformers DynamicCache (a sliding layer keeps
  its last W-1). `swap`: depths 2 and 3 read each other's layer's stored entries (each writes its own), the bug
  `layer_caches_swapped` names; `layer0_one_cache`: layer 0 at every depth through its one list of entries (the
  bridge's, then the chain's own, which the next bridge step drops), `layer0_reused` as vLLM runs it;
- `layered_engine` (tests/probe/test_explain_loop.py) with every layer's shared_head.norm / final_layernorm loaded
  from layer 0's tensor, the bug `shared_head_shared` names.
The candidate is a raw dump (d{j}/) diffed with `mtp-probe diff --explain`: caught at the right (depth, stage),
named in DIAGNOSIS. Twins: the same engines without the bug pass with no DIAGNOSIS; the variants that cannot apply
(one-layer head, a shared chain norm, a reference without depth 3) say why.
"""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from oracle.checkpoint import Checkpoint
from oracle.draft_loop import draft_projection
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.registry import head_module
from tests.helpers import FIXTURES
from tests.probe.test_explain_loop import diagnosis, explained, layered_engine, named
from tests.probe.tracekit import last_line, load_trace, write_chain_raw

TOKENS = np.array([5, 17, 3, 99, 200, 7, 42, 5, 61, 9])
N_LAYER = ("step3p7_tiny", "mimo_v2_flash_tiny")
NORMS = ("shared_head.norm.weight", "final_layernorm.weight")  # step3p7's per-layer shared_head, MiMo's


def _layered(name, tmp_path_factory):
    ckpt = FIXTURES / name
    root = tmp_path_factory.mktemp(name)
    return ckpt, export_trace(ckpt, root / "ref.h5", TOKENS, HiddenSource(seed=0), chain=ChainOptions(3))


@pytest.fixture(scope="module", params=N_LAYER)
def layered(request, tmp_path_factory):
    """(checkpoint, `export --chain 3` of 10 tokens): depth j on layer j-1, each layer its own cache."""
    return _layered(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=(*N_LAYER, "qwen3_5_tiny_3layer"))
def any_layered(request, tmp_path_factory):
    """`layered`, and the Qwen3.5 head with 3 MTP layers (one shared stem and final norm): the cache checks."""
    return _layered(request.param, tmp_path_factory)


@torch.inference_mode()
def stepwise_engine(ckpt_dir, inputs, depths: int, swap: bool = False, layer0_one_cache: bool = False,
                    fed_embed: dict | None = None):
    """(depth-1 stages, {j: stages}), teacher-forced (or fed `fed_embed`: {j: the embedding rows of the tokens an
    argmax reference fed depth j}), one token at a time (module docstring): each layer's entries are the ones its
    depth's chains wrote, in the engine's order."""
    ckpt = Checkpoint(ckpt_dir)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False)))
    projection = ckpt.read(draft_projection(ckpt).name).astype(np.float64)
    stored = {layer: [] for layer in range(head.num_layers)}  # layer -> its (k, v) entries, one per row
    reads = {1: 2, 2: 1} if swap else {}
    total, rows = inputs.num_tokens, {j: [] for j in range(1, depths + 1)}

    chain: list = []  # layer0_one_cache: this chain's own entries in layer 0's cache

    def step(layer: int, c: int, embed, hidden, position: int) -> dict:
        past = stored[reads.get(layer, layer)][:c]  # entries of bridge steps before c
        if layer0_one_cache and position > int(inputs.positions[c]):  # a chain step on layer 0's one cache
            layer, past = 0, stored[0][:c + 1] + chain
        window = head.window(layer)
        if window is not None:
            past = past[-(window - 1):] if window > 1 else []
        cache = DynamicCache()
        if past:
            cache.update(torch.cat([k for k, _ in past], dim=2), torch.cat([v for _, v in past], dim=2), layer)
        out = head.steps(rotary, torch.from_numpy(np.ascontiguousarray(embed, dtype=np.float32)).reshape(1, 1, -1),
                         torch.as_tensor(hidden).reshape(1, 1, -1), torch.tensor([[position]]), None, cache,
                         layer=layer)
        entry = (cache.layers[layer].keys[:, :, -1:], cache.layers[layer].values[:, :, -1:])
        (chain if layer0_one_cache and position > int(inputs.positions[c]) else stored[layer]).append(entry)
        return {n: v[0, 0].numpy().copy() for n, v in out.items()}

    for c in range(total):
        chain.clear()  # the next bridge step drops the chain's entries (layer0_one_cache)
        row = step(0, c, inputs.embed[c], inputs.hidden[c], int(inputs.positions[c]))
        rows[1].append(row)
        for j in range(2, depths + 1):
            if c + j - 1 > total - 1:
                break
            embed = fed_embed[j][c] if fed_embed is not None else inputs.embed[c + j - 1]  # argmax: the recorded
            row = step(j - 1, c, embed, row["out"], int(inputs.positions[c]) + j - 1)
            rows[j].append(row)

    def stacked(found):
        out = {n: np.stack([r[n] for r in found]).reshape(len(found), -1) for n in found[0]}
        out = {n: r.astype(np.int64 if r.dtype.kind in "iu" else np.float32) for n, r in out.items()}
        out["draft"] = (out["out"].astype(np.float64) @ projection.T).argmax(axis=1)[:, None].astype(np.int64)
        return out

    return stacked(rows[1]), {j: stacked(found) for j, found in rows.items() if j > 1 and found}


def _dump(ref, tmp_path, one, chains, name="c"):
    _, stages = load_trace(ref)
    return write_chain_raw(tmp_path / name, {n: one[n] for n in stages},
                           {j: {n: p[n] for n in stages} for j, p in chains.items()})


def _layer0_norm_everywhere(weights: dict) -> dict:
    """The engine loaded layer 0's shared_head.norm (MiMo: final_layernorm) into every MTP layer."""
    norms = sorted((n for n in weights if n.endswith(NORMS)), key=lambda n: [int(x) for x in n.split(".")
                                                                              if x.isdigit()])
    return {n: (weights[norms[0]] if n in norms else t) for n, t in weights.items()}


def test_swapped_layer_caches_are_caught_at_depth_2_and_named(any_layered, tmp_path):
    """Depth 2's row 0 has no past, so it matches; row 1 attends over layer 2's entry: attn at depth 2 bridge 1."""
    ckpt, ref = any_layered
    inputs, _ = load_trace(ref)
    result, report = explained(ref, _dump(ref, tmp_path, *stepwise_engine(ckpt, inputs, 3, swap=True)), tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: attn at depth 2 bridge 1" in last_line(result), result.output
    assert named(report)[:1] == ["layer_caches_swapped"], diagnosis(result)
    assert diagnosis(result).startswith("DIAGNOSIS | layer_caches_swapped reproduces the candidate"), diagnosis(result)


def test_layer0_reused_through_its_one_cache_is_named_in_that_form(layered, tmp_path):
    """vLLM's form (layer 0 and its one cache at every depth): depth 2 differs from its first per-layer stage, and
    DIAGNOSIS names layer0_reused [one cache]."""
    ckpt, ref = layered
    inputs, _ = load_trace(ref)
    cand = _dump(ref, tmp_path, *stepwise_engine(ckpt, inputs, 3, layer0_one_cache=True))
    result, report = explained(ref, cand, tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: e at depth 2 bridge 0" in last_line(result), result.output
    assert diagnosis(result).startswith("DIAGNOSIS | layer0_reused [one cache] reproduces"), diagnosis(result)


def test_twin_stepwise_engine_with_each_layer_its_own_cache_passes(any_layered, tmp_path):
    ckpt, ref = any_layered
    inputs, _ = load_trace(ref)
    result, report = explained(ref, _dump(ref, tmp_path, *stepwise_engine(ckpt, inputs, 3)), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == [], diagnosis(result)


def test_one_shared_head_for_every_layer_is_caught_at_depth_2_out_and_named(layered, tmp_path):
    """Layers 1 and 2 normalize through layer 0's norm: every stage up to res2 matches, out at depth 2 does not."""
    ckpt, ref = layered
    inputs, _ = load_trace(ref)
    cand = _dump(ref, tmp_path, *layered_engine(ckpt, inputs, 3, lambda j: j - 1,
                                                edit_weights=_layer0_norm_everywhere))
    result, report = explained(ref, cand, tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: out at depth 2 bridge 0" in last_line(result), result.output
    assert named(report)[:1] == ["shared_head_shared"], diagnosis(result)


def test_twin_layered_engine_with_its_own_norms_passes_and_a_depth_3_bug_names_neither(layered, tmp_path):
    """The per-depth engine without the bug passes. Twin of the twin: a depth-3 out nudged (no variant does that)
    is caught at depth 3, and neither N-layer variant is named although both were checked."""
    ckpt, ref = layered
    inputs, _ = load_trace(ref)
    one, chains = layered_engine(ckpt, inputs, 3, lambda j: j - 1)
    result, report = explained(ref, _dump(ref, tmp_path, one, chains), tmp_path)
    assert result.exit_code == 0 and report["diagnosis"] == [], result.output
    chains[3]["out"][1] += 0.5
    result, report = explained(ref, _dump(ref, tmp_path, one, chains, name="nudged"), tmp_path)
    assert result.exit_code == 1 and "out at depth 3 bridge 1" in last_line(result), result.output
    assert report["diagnosis"] == [], diagnosis(result)
    checked = {v["variant"]: v["status"] for v in report["variants"]}
    assert checked["layer_caches_swapped"] == checked["shared_head_shared"] == "differs"


def test_n_layer_variants_say_why_they_cannot_apply(tmp_path):
    """A one-layer head (Qwen3.5), a shared chain norm (Inkling) and a reference without depth 3: reasons, never
    a silent pass."""
    from tests.helpers import TINY
    from tests.probe.test_explain_loop import candidate

    def statuses(ckpt, depths, cand):
        ref = export_trace(ckpt, tmp_path / f"{ckpt.name}{depths}.h5", TOKENS[:8], HiddenSource(seed=1),
                           chain=ChainOptions(depths))
        result, report = explained(ref, cand(ref), tmp_path)
        assert result.exit_code == 1, result.output
        return {v["variant"]: (v["status"], v.get("reason", "")) for v in report["variants"]}

    qwen = statuses(TINY, 3, lambda ref: candidate(ref, tmp_path, TINY, 3, name="q", recycle="res2"))
    assert qwen["layer_caches_swapped"] == ("not applicable", "a one-layer head has one cache")
    assert qwen["shared_head_shared"] == ("not applicable", "a one-layer head has one shared_head")
    inkling = FIXTURES / "inkling_tiny"

    def nudged(ref):
        inputs, _ = load_trace(ref)
        one, chains = layered_engine(inkling, inputs, 3, lambda j: j - 1)
        chains[2]["out"][0] += 0.5
        return _dump(ref, tmp_path, one, chains, name="ink")

    ink = statuses(inkling, 3, nudged)
    assert ink["shared_head_shared"][0] == "not applicable" and "one norm shared" in ink["shared_head_shared"][1]
    assert ink["layer_caches_swapped"][0] == "not applicable"  # conv-state layers: said, not reproduced
    step = FIXTURES / "step3p7_tiny"

    def nudged_step(ref):
        inputs, _ = load_trace(ref)
        one, chains = layered_engine(step, inputs, 2, lambda j: j - 1)
        chains[2]["out"][0] += 0.5
        return _dump(ref, tmp_path, one, chains, name="s2")

    short = statuses(step, 2, nudged_step)
    assert short["layer_caches_swapped"][0] == "not applicable" and "--chain 3" in short["layer_caches_swapped"][1]


def test_engine_order_argmax_references_pass_the_stepwise_engine_and_the_default_names_the_convention(layered,
                                                                                                       tmp_path):
    """Argmax chains: the stepwise engine (each layer keeping the entries its depth's chains wrote, fed the
    reference's drafts) passes an `--chain-kv engine` reference at every depth; on the default reference (the
    layers' caches teacher-forced, as MtpModel.forward over the prefix) it diverges at depth 2 bridge 1 and
    --explain names layer_caches_other_convention (a convention), never a bug variant."""
    import h5py

    ckpt, _ = layered
    for kv in ("engine", "teacher-forced"):
        ref = export_trace(ckpt, tmp_path / f"{kv}.h5", TOKENS, HiddenSource(seed=0),
                           chain=ChainOptions(3, tokens="argmax", kv=kv))
        inputs, _ = load_trace(ref)
        with h5py.File(ref) as f:
            fed = {j: f[f"chain/d{j}/inputs/embed"][:] for j in (2, 3)}
        result, report = explained(ref, _dump(ref, tmp_path, *stepwise_engine(ckpt, inputs, 3, fed_embed=fed),
                                              name=kv), tmp_path)
        if kv == "engine":
            assert result.exit_code == 0 and report["diagnosis"] == [], result.output
        else:
            assert result.exit_code == 1, result.output
            assert "first divergent stage: attn at depth 2 bridge 1" in last_line(result), result.output
            assert named(report)[:1] == ["layer_caches_other_convention"], diagnosis(result)
