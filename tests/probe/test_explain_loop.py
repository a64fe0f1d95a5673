"""`--explain` names the draft loop's variants (issue 24; layer0_reused: issue 25), for engine-shaped candidates.

Each buggy candidate here is written by an engine loop of the test's own (`engine_loop`), never by the oracle's
draft loop or its variants: the head's official modules (the oracle's build_head) driven one token at a time in the
engine's order (bridge i, its chain, bridge i+1) through a transformers DynamicCache, the chain's rows cropped
after it, drafts as float64 argmax over the projection read from the checkpoint, as an engine port would. One
switch per bug. The candidate is a raw dump (d{j}/ per depth) diffed with `mtp-probe diff --explain`: it must be
caught at the right (depth, stage) and DIAGNOSIS must name the variant. Twins: the same loop without the bug
passes and gets no DIAGNOSIS of any variant.
"""

import copy
import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from oracle.checkpoint import Checkpoint
from oracle.draft_loop import draft_projection
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.registry import head_module
from oracle.loop_variants import NAMES
from tests.helpers import FIXTURES, TINY
from tests.probe.tracekit import diff_cli, last_line, load_trace, write_chain_raw

K = 4
GLM = FIXTURES / "glm4_moe_tiny"


def _swapped(weights: dict) -> dict:
    """The engine loaded its embedding-norm and hidden-norm weights into each other's slot."""
    out = dict(weights)
    for name in weights:
        for e, h in (("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"), ("enorm.weight", "hnorm.weight")):
            if name.endswith(e):
                out[name], out[name[:-len(e)] + h] = weights[name[:-len(e)] + h], weights[name]
    return out


@torch.inference_mode()
def engine_loop(ckpt_dir, inputs, depths: int, *, recycle: str | None = None, recycle_main: bool = False,
                frozen: bool = False, keep_kv: bool = False, embed_draft: bool = False, swap_norms: bool = False,
                chain_embed: dict | None = None):
    """(depth-1 stages, {j: depth-j stages}) of a one-layer head run as an engine does (module docstring).
    `chain_embed`: {j: (n_j, D)} the embedding rows an argmax-chain reference hands depth j (its recorded
    drafts), fed instead of the step tokens' (x_{i+j})."""
    ckpt = Checkpoint(ckpt_dir)
    impl = head_module(ckpt.family)
    weights = impl.torch_weights(ckpt.read_head(widen=False))
    head, rotary = impl.build_head(ckpt.config, _swapped(weights) if swap_norms else weights)
    recycle = recycle or ckpt.family.recycled
    tables = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed.weight")  # V4: embed
    table = next(t for t in tables if t in ckpt.names()) if embed_draft else draft_projection(ckpt).name
    projection = ckpt.read(table).astype(np.float64)  # (V, D)
    cache = DynamicCache(config=head.text_config)  # a sliding-window cache where the head has a window (V4)
    sliding = ckpt.family.attention_window(ckpt.config) is not None
    total = inputs.num_tokens

    def step(where, row: np.ndarray, hidden, position: int) -> dict:
        e = torch.from_numpy(np.ascontiguousarray(row, dtype=np.float32).reshape(1, 1, -1))
        rows = head.steps(rotary, e, torch.as_tensor(hidden).reshape(1, 1, -1), torch.tensor([[position]]), None,
                          where)
        return {n: v[0, 0].numpy().copy() for n, v in rows.items()}

    bridge, chains = [], {j: [] for j in range(2, depths + 1)}
    for i in range(total):
        row = step(cache, inputs.embed[i], inputs.hidden[i], int(inputs.positions[i]))
        bridge.append(row)
        work = copy.deepcopy(cache) if sliding and not keep_kv else cache  # a window cache cannot be cropped back
        added = 0
        for j in range(2, depths + 1):
            if i + j - 1 > total - 1:
                break
            hidden = inputs.hidden[i] if recycle_main else row[recycle]
            fed = inputs.embed[i + j - 1] if chain_embed is None else chain_embed[j][i]  # x_{i+j} or the draft
            row = step(work, fed, hidden, int(inputs.positions[i]) + (0 if frozen else j - 1))
            chains[j].append(row)
            added += 1
        if added and not keep_kv and not sliding:
            cache.crop(-added)  # the chain's entries dropped: bridge i+1 sees bridge rows only

    def stacked(rows):
        out = {n: np.stack([r[n] for r in rows]).reshape(len(rows), -1) for n in rows[0]}
        out = {n: r.astype(np.int64 if r.dtype.kind in "iu" else np.float32) for n, r in out.items()}  # ids: int64
        out["draft"] = (out["out"].astype(np.float64) @ projection.T).argmax(axis=1)[:, None].astype(np.int64)
        return out

    return stacked(bridge), {j: stacked(rows) for j, rows in chains.items() if rows}


def recorded_chain_embed(ref) -> dict:
    """{j: the embedding rows the reference hands depth j} (/chain/d{j}/inputs/embed), as the probe feeds them."""
    from oracle.trace import ChainDepthReader, chain_info, read_trace

    with read_trace(ref) as reader:
        return {j: ChainDepthReader(reader, j).input_rows("embed") for j in chain_info(reader).chain_depths}


def candidate(ref, tmp_path, ckpt_dir=TINY, depths=K, name="c", fed: bool = False, **bug):
    """The engine's raw dump, holding only the stages the reference has (`fed`: fed the reference's recorded
    chain inputs, as the probe drives an argmax-chain reference)."""
    inputs, stages = load_trace(ref)
    one, chains = engine_loop(ckpt_dir, inputs, depths, chain_embed=recorded_chain_embed(ref) if fed else None,
                              **bug)
    keep = set(stages)
    return write_chain_raw(tmp_path / name, {n: r for n, r in one.items() if n in keep},
                           {j: {n: r for n, r in part.items() if n in keep} for j, part in chains.items()})


def diagnosis(result) -> str:
    return next(line for line in result.output.splitlines() if line.startswith("DIAGNOSIS"))


def explained(ref, cand, tmp_path):
    result = diff_cli(ref, cand, "--explain", "--json", tmp_path / "r.json")
    return result, json.loads((tmp_path / "r.json").read_text())["explain"]


def named(report: dict) -> list[str]:
    return [d["variant"] for d in report["diagnosis"]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A real `export --chain 4` of the tiny Qwen3.5 fixture, T = 10."""
    root = tmp_path_factory.mktemp("qwen-loop")
    tokens = np.array([17, 3, 99, 250, 41, 7, 300, 12, 5, 88])
    return export_trace(TINY, root / "ref.h5", tokens, HiddenSource(seed=0), chain=ChainOptions(K))


# (bug switch, the (depth, stage) the diff must name first, the variant DIAGNOSIS must name)
QWEN_BUGS = [
    ({"recycle": "res2"}, "h at depth 2 bridge 0", "recycle_prenorm"),
    ({"recycle_main": True}, "h at depth 2 bridge 0", "recycle_main_hidden"),
    ({"frozen": True}, "attn at depth 2 bridge 0", "position_frozen"),
    ({"keep_kv": True}, "attn at token 1", "chain_kv_kept"),
    ({"embed_draft": True}, "draft at token 0", "draft_embed_tokens"),
    ({"swap_norms": True}, "e at token 0", "enorm_hnorm_swap"),
]


@pytest.mark.parametrize("bug, where, variant", QWEN_BUGS, ids=[v for _, _, v in QWEN_BUGS])
def test_each_loop_bug_is_caught_where_it_shows_and_named(qwen, tmp_path, bug, where, variant):
    result, report = explained(qwen, candidate(qwen, tmp_path, **bug), tmp_path)
    assert result.exit_code == 1, result.output
    assert f"first divergent stage: {where}" in last_line(result), result.output
    assert named(report)[:1] == [variant], diagnosis(result)
    assert diagnosis(result).startswith(f"DIAGNOSIS | {variant} reproduces the candidate"), diagnosis(result)


def test_twin_the_correct_engine_loop_passes_with_no_diagnosis(qwen, tmp_path):
    result, report = explained(qwen, candidate(qwen, tmp_path), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == [] and "nothing to diagnose" in diagnosis(result)


def test_twin_a_bug_no_variant_explains_names_none(qwen, tmp_path):
    """A chain whose depth-3 out is off (no variant does that): caught at depth 3, and no loop variant is named,
    although every one was checked against the captured depths."""
    inputs, stages = load_trace(qwen)
    one, chains = engine_loop(TINY, inputs, K)
    chains[3]["out"][2] += 0.5
    cand = write_chain_raw(tmp_path / "c", {n: one[n] for n in stages},
                           {j: {n: p[n] for n in stages} for j, p in chains.items()})
    result, report = explained(qwen, cand, tmp_path)
    assert result.exit_code == 1 and "out at depth 3 bridge 2" in last_line(result), result.output
    assert report["diagnosis"] == []
    assert diagnosis(result).startswith("DIAGNOSIS | no known variant reproduces the candidate: depth 3")
    checked = {v["variant"]: v["status"] for v in report["variants"]}
    assert {checked[n] for n in ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept")} \
        == {"differs"}
    assert checked["layer0_reused"] == "not applicable"  # a one-layer head


def test_twin_loop_variants_need_the_depths_they_show_at(qwen, tmp_path):
    """The recycle bug's candidate without its chain depths: depth 1 matches, so it cannot be diagnosed (and the
    diff says the loop was not checked), never named from rows it does not hold."""
    inputs, stages = load_trace(qwen)
    one, _ = engine_loop(TINY, inputs, K, recycle="res2")
    result, report = explained(qwen, write_chain_raw(tmp_path / "c", {n: one[n] for n in stages}, {}), tmp_path)
    assert result.exit_code == 3, result.output
    assert report["diagnosis"] == []


def test_variant_names_are_the_agreed_ones():
    assert NAMES == ("recycle_prenorm", "recycle_main_hidden", "position_frozen", "chain_kv_kept", "layer0_reused",
                     "draft_embed_tokens", "enorm_hnorm_swap", "layer_caches_swapped",
                     "layer_caches_other_convention", "shared_head_shared")


# --- GLM-4.5: vLLM 0.33.0's MTP head recycles its un-normed residual --------------------------------------------

@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-loop")
    tokens = np.random.default_rng(5).integers(0, Checkpoint(GLM).config.vocab_size, 8)
    return export_trace(GLM, root / "ref.h5", tokens, HiddenSource(seed=1), chain=ChainOptions(3))


def test_glm_head_recycling_its_unnormed_residual_is_caught_at_depth_2_as_recycle_prenorm(glm, tmp_path):
    result, report = explained(glm, candidate(glm, tmp_path, GLM, 3, recycle="res2"), tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: h at depth 2 bridge 0" in last_line(result), result.output
    assert named(report)[:1] == ["recycle_prenorm"], diagnosis(result)


def test_glm_enorm_hnorm_swap_is_named(glm, tmp_path):
    result, report = explained(glm, candidate(glm, tmp_path, GLM, 3, swap_norms=True), tmp_path)
    assert result.exit_code == 1 and "first divergent stage: e at token 0" in last_line(result), result.output
    assert named(report)[:1] == ["enorm_hnorm_swap"], diagnosis(result)


def test_twin_glm_correct_engine_passes(glm, tmp_path):
    result, report = explained(glm, candidate(glm, tmp_path, GLM, 3), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == []


# --- N-layer heads (issue 25): layer 0 at every depth, as vLLM's proposer without spec_step_idx -----------------

@torch.inference_mode()
def layered_engine(ckpt_dir, inputs, depths: int, layer_of, swap_norms: bool = False, edit_weights=None):
    """(depth-1 stages, {j: stages}) of an N-layer head as a teacher-forced engine runs it: depth j is layer
    `layer_of(j)` over its n_j rows (token x_{i+j}, the previous depth's out, position p_i + j - 1) as one causal
    pass of that layer, the bridge step layer 0's. `edit_weights`: the engine's loading bug (tensors -> tensors)."""
    from oracle.families import mtp_model

    ckpt = Checkpoint(ckpt_dir)
    impl = head_module(ckpt.family)
    weights = impl.torch_weights(ckpt.read_head(widen=False))
    weights = _swapped(weights) if swap_norms else weights
    head, rotary = impl.build_head(ckpt.config, edit_weights(weights) if edit_weights else weights)
    projection = ckpt.read(draft_projection(ckpt).name).astype(np.float64)
    positions = torch.from_numpy(np.asarray(inputs.positions, dtype=np.int64))

    def run(layer, embed, hidden, p):
        rows = head.steps(rotary, torch.from_numpy(embed)[None], torch.as_tensor(hidden)[None], p[None],
                          mtp_model.layer_mask(p, head.window(layer)), None, layer=layer)
        out = {n: v[0].reshape(len(p), -1).numpy().copy() for n, v in rows.items()}
        out = {n: r.astype(np.int64 if r.dtype.kind in "iu" else np.float32) for n, r in out.items()}
        out["draft"] = (out["out"].astype(np.float64) @ projection.T).argmax(axis=1)[:, None].astype(np.int64)
        return out

    one = run(0, inputs.embed, inputs.hidden, positions)
    previous, chains = one, {}
    for j in range(2, depths + 1):
        n = inputs.num_tokens - j + 1
        previous = chains[j] = run(layer_of(j), inputs.embed[j - 1:j - 1 + n], previous["out"][:n],
                                   positions[:n] + j - 1)
    return one, chains


@pytest.fixture(scope="module")
def step3p7(tmp_path_factory):
    """A tiny 3-layer step3p7 checkpoint and its `export --chain 3` (depth j on layer j-1)."""
    from tests.helpers import load_script

    root = tmp_path_factory.mktemp("step3p7-loop")
    ckpt = load_script("make_fixtures").write_mtp_model_checkpoint(root / "ckpt", "step3p7")
    tokens = np.array([5, 17, 3, 99, 200, 7, 42, 5, 61, 9])
    return ckpt, export_trace(ckpt, root / "ref.h5", tokens, HiddenSource(seed=0), chain=ChainOptions(3))


def layered_candidate(ckpt, ref, tmp_path, layer_of, name="c", **bug):
    inputs, stages = load_trace(ref)
    one, chains = layered_engine(ckpt, inputs, 3, layer_of, **bug)
    return write_chain_raw(tmp_path / name, {n: one[n] for n in stages},
                           {j: {n: p[n] for n in stages} for j, p in chains.items()})


def test_layer0_reused_is_caught_at_depth_2_and_named(step3p7, tmp_path):
    ckpt, ref = step3p7
    result, report = explained(ref, layered_candidate(ckpt, ref, tmp_path, lambda j: 0), tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: e at depth 2 bridge 0" in last_line(result), result.output  # enorm is per layer
    assert named(report)[:1] == ["layer0_reused"], diagnosis(result)
    # layer 0's weights, each depth its own cache (an engine loading layer 0 into every layer); vLLM's one-cache
    # form: tests/probe/test_explain_loop_layers.py
    assert diagnosis(result).startswith("DIAGNOSIS | layer0_reused [per-depth caches] reproduces the candidate"), \
        diagnosis(result)
    statuses = {v["variant"]: v["status"] for v in report["variants"]}
    assert statuses["chain_kv_kept"] == "not applicable"  # each layer keeps its own cache


def test_twin_each_layer_at_its_own_depth_passes(step3p7, tmp_path):
    ckpt, ref = step3p7
    result, report = explained(ref, layered_candidate(ckpt, ref, tmp_path, lambda j: j - 1), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == []


def test_twin_a_layer_swap_no_variant_makes_is_not_called_layer0_reused(step3p7, tmp_path):
    """Depth 2 on layer 2 (and depth 3 on layer 1): caught at depth 2, and layer0_reused is not named."""
    ckpt, ref = step3p7
    result, report = explained(ref, layered_candidate(ckpt, ref, tmp_path, lambda j: 4 - j), tmp_path)
    assert result.exit_code == 1 and "at depth 2 bridge 0" in last_line(result), result.output
    assert "layer0_reused" not in named(report), diagnosis(result)


def test_step3p7_enorm_hnorm_swap_is_named(step3p7, tmp_path):
    ckpt, ref = step3p7
    cand = layered_candidate(ckpt, ref, tmp_path, lambda j: j - 1, swap_norms=True)
    result, report = explained(ref, cand, tmp_path)
    assert result.exit_code == 1 and "first divergent stage: e at token 0" in last_line(result), result.output
    assert named(report)[:1] == ["enorm_hnorm_swap"], diagnosis(result)


# --- layer per depth in the report (issue 25) --------------------------------------------------------------------

def test_report_says_which_layer_each_depth_ran_and_the_modulo_convention(step3p7, tmp_path):
    """--chain 4 --chain-layers modulo on a 3-layer head: depth 4 ran layer 0, and the report says the % N
    convention was used; a correct engine running that convention passes. Twin: the per-depth reference's report
    names layers 0..2 and no % convention."""
    ckpt, per_depth = step3p7
    tokens = load_trace(per_depth)[0].token_ids
    modulo = export_trace(ckpt, tmp_path / "mod.h5", tokens, HiddenSource(seed=0),
                          chain=ChainOptions(4, layers="modulo"))
    inputs, stages = load_trace(modulo)
    one, chains = layered_engine(ckpt, inputs, 4, lambda j: (j - 1) % 3)
    cand = write_chain_raw(tmp_path / "c", {n: one[n] for n in stages},
                           {j: {n: p[n] for n in stages} for j, p in chains.items()})
    result = diff_cli(modulo, cand, "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert ("layer per depth (the reference's physical MTP layer of 3): depth 1 layer 0, depth 2 layer 1, depth 3 "
            "layer 2, depth 4 layer 0; convention: depth j runs layer (j-1) % N (vLLM's spec_step_idx % N); depths "
            "past 3 reuse layers by the % 3 convention") in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert [d["layer"] for d in report["depths"]] == [0, 1, 2, 0]
    assert "spec_step_idx % N" in report["chain"]["layer_convention"]
    twin = diff_cli(per_depth, layered_candidate(ckpt, per_depth, tmp_path, lambda j: j - 1, name="twin"))
    assert "depth 2 layer 1, depth 3 layer 2; convention: depth j runs layer j-1" in twin.output, twin.output
    assert "% 3 convention" not in twin.output


# --- the other families: the same variants through the same family-neutral module ---------------------------------

FAMILY_FIXTURES = {"deepseek_v3": "deepseek_v3_tiny", "deepseek_v4": "deepseek_v4_tiny",
                   "qwen3_5_moe": "qwen3_5_moe_tiny", "qwen3_next": "qwen3_next_tiny_fused"}


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(name, checkpoint, `export --chain 3` of 8 tokens) of the family named by the test's parameter."""
    ckpt = FIXTURES / FAMILY_FIXTURES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tokens = np.random.default_rng(7).integers(0, Checkpoint(ckpt).config.vocab_size, 8)
    return request.param, ckpt, export_trace(ckpt, root / "ref.h5", tokens, HiddenSource(seed=2),
                                             chain=ChainOptions(3))


BUGS = {"recycle_prenorm": ({"recycle": "res2"}, "h at depth 2 bridge 0"),
        "recycle_main_hidden": ({"recycle_main": True}, "h at depth 2 bridge 0"),
        "position_frozen": ({"frozen": True}, "attn at depth 2 bridge 0"),
        "chain_kv_kept": ({"keep_kv": True}, "attn at token 1"),
        "draft_embed_tokens": ({"embed_draft": True}, "draft at token 0"),
        "enorm_hnorm_swap": ({"swap_norms": True}, "e at token 0")}
# DeepSeek-V4 has no pre-norm tensor of its streams' width (recycle_prenorm does not apply), and its sliding-window
# cache cannot be cropped back, which this test engine's kept-KV switch relies on.
FAMILY_BUGS = {"deepseek_v3": tuple(BUGS), "qwen3_5_moe": ("recycle_prenorm", "chain_kv_kept", "enorm_hnorm_swap"),
               "qwen3_next": ("position_frozen", "draft_embed_tokens", "recycle_main_hidden"),
               "deepseek_v4": ("recycle_main_hidden", "position_frozen", "draft_embed_tokens", "enorm_hnorm_swap")}


@pytest.mark.parametrize("family, variant", [(f, v) for f in sorted(FAMILY_BUGS) for v in FAMILY_BUGS[f]],
                         indirect=["family"], ids=[f"{f}-{v}" for f in sorted(FAMILY_BUGS) for v in FAMILY_BUGS[f]])
def test_family_loop_bugs_are_named(family, tmp_path, variant):
    name, ckpt, ref = family
    bug, where = BUGS[variant]
    result, report = explained(ref, candidate(ref, tmp_path, ckpt, 3, **bug), tmp_path)
    assert result.exit_code == 1, result.output
    assert f"first divergent stage: {where}" in last_line(result), result.output
    assert named(report)[:1] == [variant], diagnosis(result)


@pytest.mark.parametrize("family", sorted(FAMILY_BUGS), indirect=True)
def test_twin_family_correct_engine_passes(family, tmp_path):
    name, ckpt, ref = family
    result, report = explained(ref, candidate(ref, tmp_path, ckpt, 3), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == []


@pytest.mark.parametrize("family", ["deepseek_v4"], indirect=True)
def test_v4_recycle_prenorm_does_not_apply(family, tmp_path):
    """V4 recycles its block's streams and has no pre-norm tensor of their width: never named, said why."""
    name, ckpt, ref = family
    result, report = explained(ref, candidate(ref, tmp_path, ckpt, 3, frozen=True), tmp_path)
    statuses = {v["variant"]: (v["status"], v.get("reason", "")) for v in report["variants"]}
    assert statuses["recycle_prenorm"] == ("not applicable", "the deepseek_v4 head has no pre-norm tensor of the "
                                                             "recycled width")


# --- argmax-chain references: the variants run on the reference's recorded chain tokens ------------------------

@pytest.fixture(scope="module")
def qwen_argmax(tmp_path_factory):
    """`export --chain 4 --chain-tokens argmax` of the tiny Qwen3.5 fixture: depth j is fed the head's own drafts."""
    root = tmp_path_factory.mktemp("qwen-argmax")
    tokens = np.array([17, 3, 99, 250, 41, 7, 300, 12, 5, 88])
    return export_trace(TINY, root / "ref.h5", tokens, HiddenSource(seed=0), chain=ChainOptions(K, tokens="argmax"))


def test_argmax_reference_feeds_chain_tokens_that_are_not_the_step_tokens(qwen_argmax):
    """The premise of the tests below: the recorded drafts differ from x_{i+j}, so a variant fed the step tokens
    (or drafting its own) would be compared on other inputs."""
    from oracle.trace import ChainDepthReader, read_trace

    with read_trace(qwen_argmax) as reader:
        fed = ChainDepthReader(reader, 2).input_rows("token_ids").reshape(-1)
        steps = reader.inputs().token_ids
    assert (fed != steps[1:1 + len(fed)]).any()


ARGMAX_BUGS = [({"recycle": "res2"}, "h at depth 2 bridge 0", "recycle_prenorm"),
               ({"recycle_main": True}, "h at depth 2 bridge 0", "recycle_main_hidden"),
               ({"frozen": True}, "attn at depth 2 bridge 0", "position_frozen"),
               ({"keep_kv": True}, "attn at token 1", "chain_kv_kept")]


@pytest.mark.parametrize("bug, where, variant", ARGMAX_BUGS, ids=[v for _, _, v in ARGMAX_BUGS])
def test_argmax_chain_loop_bugs_are_named(qwen_argmax, tmp_path, bug, where, variant):
    """An engine fed the argmax reference's chain inputs (as `mtp-probe run` feeds them) with one loop bug: caught
    where it shows and named, the variant run on the same recorded tokens (never its own drafts)."""
    result, report = explained(qwen_argmax, candidate(qwen_argmax, tmp_path, fed=True, **bug), tmp_path)
    assert result.exit_code == 1, result.output
    assert f"first divergent stage: {where}" in last_line(result), result.output
    assert named(report)[:1] == [variant], diagnosis(result)
    assert "ran on the reference's recorded chain tokens" in result.output


def test_twin_argmax_chain_correct_engine_gets_no_diagnosis(qwen_argmax, tmp_path):
    result, report = explained(qwen_argmax, candidate(qwen_argmax, tmp_path, fed=True), tmp_path)
    assert result.exit_code == 0, result.output
    assert report["diagnosis"] == [] and "nothing to diagnose" in diagnosis(result)


def test_twin_argmax_chain_engine_fed_the_step_tokens_is_caught_and_not_named(qwen_argmax, tmp_path):
    """A correct engine fed x_{i+j} where the reference fed its drafts: depth 2 diverges from its first stage,
    and no variant (each fed the recorded tokens) reproduces it."""
    result, report = explained(qwen_argmax, candidate(qwen_argmax, tmp_path), tmp_path)
    assert result.exit_code == 1 and "first divergent stage: e at depth 2" in last_line(result), result.output
    assert not set(named(report)) & set(NAMES), diagnosis(result)


ARGMAX_FAMILIES = ("deepseek_v3_tiny", "deepseek_v4_tiny", "glm4_moe_tiny", "qwen3_5_moe_tiny",
                   "qwen3_next_tiny_fused", "mimo_v2_flash_tiny", "step3p7_tiny", "inkling_tiny")


@pytest.mark.parametrize("fixture", ARGMAX_FAMILIES)
def test_every_family_variant_loop_on_recorded_tokens_is_the_argmax_reference(fixture, tmp_path):
    """The loop the variants change, fed the recorded chain tokens, reproduces each family's argmax-chain
    reference exactly at every depth (so a variant differs from it only by its one change). Twin: the same loop
    fed the step tokens instead differs from depth 2."""
    from oracle.draft_loop import TEACHER
    from oracle.loop_variants import _replace
    from oracle.trace import ChainDepthReader, chain_info, read_trace
    from oracle.variants import Explainer
    from probe.explain import _chain_tokens

    ckpt = FIXTURES / fixture
    tokens = np.random.default_rng(3).integers(0, Checkpoint(ckpt).config.vocab_size, 7)
    ref = export_trace(ckpt, tmp_path / "ref.h5", tokens, HiddenSource(seed=4), chain=ChainOptions(3, tokens="argmax"))
    with read_trace(ref) as reader:
        info, inputs = chain_info(reader), reader.inputs()
        fed = _chain_tokens(reader, info)
        want = {j: {n: ChainDepthReader(reader, j).stage_rows(n) for n in ChainDepthReader(reader, j).stages}
                for j in info.chain_depths}
        depth1 = {n: reader.stage_rows(n) for n in reader.stages}
        digest = reader.attrs.get("checkpoint_digest")
    runner = Explainer(ckpt, inputs, {}, digest, reference=depth1).loop_variants(info, fed)
    got = runner.loop()
    for j, stages in want.items():
        for name, rows in stages.items():
            np.testing.assert_array_equal(got[j][name], rows, err_msg=f"{fixture} depth {j} {name}")
    if runner.multi_layer:  # the twin: N-layer argmax rows fed as teacher-forced step tokens
        other = runner.loop(spec=_replace(runner.spec(), fed=None, tokens=TEACHER))
    else:
        other = runner.loop(spec=_replace(runner.spec(), fed=lambda j: inputs.token_ids[j - 1:]))
    assert not np.array_equal(other[2]["e"], want[2]["e"])


def test_argmax_reference_without_recorded_tokens_says_why():
    """An argmax-chain reference whose depths record no token_ids: every chain variant is a reason, never a pass."""
    from oracle.loop_variants import LoopVariants
    from oracle.trace import ChainInfo

    info = ChainInfo(3, "argmax", "out", (0, 0), 1, "dropped_after_chain")
    runner = LoopVariants.__new__(LoopVariants)
    runner.info, runner.chain_tokens, runner.head = info, {2: np.zeros(3, dtype=np.int64)}, object()
    runner.family = Checkpoint(TINY).family
    assert "records no /chain/d{j}/inputs/token_ids" in runner._not_applicable("recycle_prenorm")
