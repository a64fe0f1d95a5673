"""The q/k-path part records at every depth of an N-layer head (issue 25): `export --chain K` on a Step-3.7 head
measures depth j's parts on the layer that depth ran (layer j-1; (j-1) % N under --chain-layers modulo), on the
depth's own rows and mask, with that layer's own parts (oracle/qk_parts.py layer_part_records): the tiny head's
layer 0 is full attention with a partial rotary, layer 1 sliding with a full one, so depth 2 lists a window and no
RoPE all_dims, depth 1 and 3 the reverse (evidence_rules.qk_parts_at_depth names each depth's columns).

A candidate whose layer 1 alone is wrong (RoPE off, or its window one key wider) passes depth 1 and diverges at
depth 2, whose q/k lines list that part as evidenced. Twins: the same candidate with depth 2's attn not captured
claims nothing there; an argmax-chain reference (rows the trace does not hold) says "not measured" at depth 2; the
unaltered pass the records come from reproduces each depth's recorded attn rows on its own layer, not on layer 0."""

import json
import shutil

import h5py
import numpy as np
import pytest
import torch

from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.mtp_model import MtpModelHead
from oracle.qk_parts import rotary_off
from probe.diff import diff_traces
from probe.report import depth_not_measured, depth_qk_lines, qk_lines
from tests.helpers import FIXTURES

STEP = FIXTURES / "step3p7_tiny"
TOKENS = np.array([5, 17, 3, 99, 200, 7, 42, 5, 61, 9], dtype=np.int64)
FULL_LAYER = {"rope": ["absent", "all_dims", "interleaved"], "q_norm": ["absent", "w_not_1_plus_w"],
              "k_norm": ["absent", "w_not_1_plus_w"], "kv_append": ["own_key_missing", "only_own_key"]}
SLIDING_LAYER = {"rope": ["absent", "interleaved"], "q_norm": ["absent", "w_not_1_plus_w"],
                 "k_norm": ["absent", "w_not_1_plus_w"], "kv_append": ["own_key_missing", "only_own_key"],
                 "window": ["one_less", "one_more", "none"]}


def _export(out, chain=ChainOptions(3), **patches):
    """export --chain on the Step-3.7 fixture, MtpModelHead's methods replaced by `patches` (a wrong candidate)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in patches.items():
            mp.setattr(MtpModelHead, name, value)
        return export_trace(STEP, out, TOKENS, HiddenSource(seed=0), chain=chain)


_rope, _window = MtpModelHead.rope, MtpModelHead.window


def _layer1_rope_off(self, rotary, x, positions, layer):
    rope = _rope(self, rotary, x, positions, layer)
    return rotary_off(*rope) if layer == 1 else rope


def _layer1_window_wider(self, layer):
    window = _window(self, layer)
    return window + 1 if layer == 1 else window


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("qk-layers")
    return {"ref": _export(root / "ref.h5"), "rope": _export(root / "rope.h5", rope=_layer1_rope_off),
            "window": _export(root / "window.h5", window=_layer1_window_wider), "root": root}


def _depth(report, j):
    return next(d for d in report.chain.depths if d.depth == j).report


def test_each_depth_records_its_own_layers_parts(traces):
    with h5py.File(traces["ref"]) as f:
        rules = json.loads(f.attrs["evidence_rules"])
        assert rules["qk_parts"] == FULL_LAYER  # depth 1: layer 0
        assert rules["qk_parts_at_depth"] == {"2": SLIDING_LAYER, "3": FULL_LAYER}
        for j, parts in ((2, SLIDING_LAYER), (3, FULL_LAYER)):
            assert list(f[f"chain/d{j}/inputs/layer"][:2]) == [j - 1] * 2
            for part, names in parts.items():
                rows = f[f"chain/d{j}/evidence/qk_{part}"][:]
                assert rows.shape == (len(TOKENS) - j + 1, len(names)) and (rows > 0).any(), (j, part)
            assert ("qk_window" in f[f"chain/d{j}/evidence"]) == (j == 2)
        # measured on the depth's own rows: depth 3 (layer 2) is not depth 1's (layer 0) copied
        assert not np.array_equal(f["chain/d3/evidence/qk_rope"][:], f["evidence/qk_rope"][:8])


@pytest.mark.parametrize("broken, part", [("rope", "RoPE"), ("window", "sliding window")])
def test_a_part_broken_in_layer_1_only_diverges_at_depth_2_where_it_is_evidenced(traces, broken, part):
    report = diff_traces(traces["ref"], traces[broken])
    assert report.verdict.name == "diverged"
    assert report.chain.bridge_verdict.name == "pass"
    depth, first = report.first_at
    assert (depth, first.stage) == (2, "attn"), report.first_at
    lines = depth_qk_lines(_depth(report, 2))
    line = next(x for x in lines if f", {part}:" in x)
    assert line.startswith(f"depth 2: q/k path, {part}: evidenced"), lines
    # depth 1 runs layer 0 (full attention): no window part is listed there, nothing borrowed from depth 2
    assert not any("sliding window" in x for x in qk_lines(report)), qk_lines(report)


def test_twin_the_unbroken_candidate_passes_every_depth(traces, tmp_path):
    report = diff_traces(traces["ref"], shutil.copy(traces["ref"], tmp_path / "cand.h5"))
    assert report.verdict.name == "pass"
    for j, parts in ((2, SLIDING_LAYER), (3, FULL_LAYER)):
        lines = depth_qk_lines(_depth(report, j))
        assert len(lines) == len(parts) and all(": evidenced:" in x for x in lines), lines


def test_twin_depth_2_attn_not_captured_claims_no_part_there(traces, tmp_path):
    cand = shutil.copy(traces["rope"], tmp_path / "cand.h5")
    with h5py.File(cand, "r+") as f:
        del f["chain/d2/stages/attn"]
        sums = json.loads(f.attrs["stage_checksums"])
        f.attrs["stage_checksums"] = json.dumps({k: v for k, v in sums.items() if k != "d2/attn"})
    report = diff_traces(traces["ref"], cand)
    lines = depth_qk_lines(_depth(report, 2))
    assert lines and not any(": evidenced:" in x for x in lines), lines
    assert next(x for x in lines if "RoPE" in x) == "depth 2: q/k path, RoPE: NOT evidenced: attn not captured"


def test_twin_argmax_chains_of_an_n_layer_head_are_not_measured(traces):
    ref = _export(traces["root"] / "argmax.h5", chain=ChainOptions(3, tokens="argmax"))
    with h5py.File(ref) as f:
        assert "qk_parts_at_depth" not in json.loads(f.attrs["evidence_rules"])
        assert not [k for k in f["chain/d2/evidence"] if k.startswith("qk_")]
    report = diff_traces(ref, shutil.copy(ref, traces["root"] / "argmax_cand.h5"))
    assert depth_qk_lines(_depth(report, 2)) == ["depth 2: " + depth_not_measured(2)]


def test_modulo_layers_measure_the_layer_each_depth_ran(traces):
    """--chain-layers modulo, K = 4 > N = 3: depth 4 runs layer 0 again, and its parts are layer 0's."""
    ref = _export(traces["root"] / "modulo.h5", chain=ChainOptions(4, layers="modulo"))
    with h5py.File(ref) as f:
        rules = json.loads(f.attrs["evidence_rules"])
        assert rules["qk_parts_at_depth"] == {"2": SLIDING_LAYER, "3": FULL_LAYER, "4": FULL_LAYER}
        assert list(f["chain/d4/inputs/layer"][:1]) == [0]
    report = diff_traces(ref, shutil.copy(ref, traces["root"] / "modulo_cand.h5"))
    lines = depth_qk_lines(_depth(report, 4))
    assert len(lines) == len(FULL_LAYER) and all(": evidenced:" in x for x in lines), lines


@pytest.mark.parametrize("family", ["step3p7", "mimo_v2_flash", "inkling"])
def test_the_unaltered_pass_gives_each_depths_attn_rows_on_its_own_layer(family, traces):
    """qk_part_variants' pass without a variant (the depth's ah, positions, causal windowed mask, a fresh cache:
    Inkling's MtpCache) through layer j-1's official attention reproduces depth j's recorded attn rows, so every
    record measures a variant against the depth's own rows; through layer 0 it does not (the twin)."""
    from oracle.checkpoint import Checkpoint
    from oracle.families.registry import head_module

    fixture = FIXTURES / f"{family}_tiny"
    ref = traces["ref"] if family == "step3p7" else export_trace(fixture, traces["root"] / f"{family}.h5", TOKENS,
                                                                  HiddenSource(seed=0), chain=ChainOptions(3))
    ckpt = Checkpoint(fixture)
    impl = head_module(ckpt.family)
    head, rotary = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False, digest=False)))
    with h5py.File(ref) as f, torch.inference_mode():
        assert set(json.loads(f.attrs["evidence_rules"])["qk_parts_at_depth"]) == {"2", "3"}
        for j in (2, 3):
            ah = torch.from_numpy(f[f"chain/d{j}/stages/ah"][:])[None]
            positions = torch.from_numpy(f[f"chain/d{j}/inputs/positions"][:])[None]
            attn = f[f"chain/d{j}/stages/attn"][:]
            for layer, same in ((j - 1, True), (0, False)):
                mask = impl.layer_mask(positions[0], head.window(layer))
                rows = head.mtp.layers[layer].mtp_block.self_attn(
                    hidden_states=ah, position_embeddings=head.rope(rotary, ah, positions, layer),
                    attention_mask=mask, position_ids=positions, cache=head.pass_cache())[0][0].numpy()
                assert np.allclose(rows, attn, rtol=1e-5, atol=1e-6) == same, (family, j, layer)
