"""Multi-layer MTP heads on transformers' MtpModel (issue 25): every depth of the oracle's chains equals the official
`MtpModel.forward` drafting through its own `MtpCache`, loaded by `MtpModel.from_pretrained` (transformers' own
file reading and conversions, not the oracle's); layer per depth is recorded and evidenced; a layer count that
disagrees with the tensors exits 2 naming both; `--chain` deeper than the layers exits 2 unless modulo.

The shared family contract (stepwise = batched, strict loading, stage-first-seen at depth 1) runs these families
through tests/families/test_family_contract.py; here the stage-first-seen check runs at every depth."""

import copy
import importlib
import json

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families.mtp_model import MODELS, official_config
from oracle.families.registry import FAMILIES, head_module
from oracle.trace import TraceInputs, read_trace, write_trace
from probe.diff import diff_traces
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5,61,9"
# held-out dims: no fixture uses them (4 layers; a sliding window the 10 steps exceed)
HELD_OUT = {"step3p7": {"hidden_size": 48, "head_dim": 12, "num_nextn_predict_layers": 4, "sliding_window": 3,
                        "n_routed_experts": 6, "vocab_size": 230},
            # 4 layers (fixture 3), other widths, a longer convolution, a shorter relative extent, another muP
            # multiplier and unpadded vocabulary
            "inkling": {"hidden_size": 48, "head_dim": 12, "num_nextn_predict_layers": 4, "num_hidden_layers": 5,
                        "vocab_size": 230, "unpadded_vocab_size": 221, "rel_extent": 5, "sconv_kernel_size": 4,
                        "logits_mup_width_multiplier": 3.0, "intermediate_size": 80}}
FAMILY_NAMES = sorted(HELD_OUT)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def chained(request, tmp_path_factory):
    """(family, checkpoint, trace with every depth 2..N recorded)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    ckpt = FIXTURES.write_mtp_model_checkpoint(root / "ckpt", name, HELD_OUT[name])
    layers = Checkpoint(ckpt).config.num_mtp_layers
    out = root / "chain.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", str(layers), "-q"])
    assert result.exit_code == 0, result.output
    return name, ckpt, out


def official_mtp_model(ckpt):
    """transformers' own MtpModel.from_pretrained over a real tiny main model whose embedding and lm_head are the
    checkpoint's (the rest of the main model is never run)."""
    from transformers.modeling_layers import MtpModel

    cfg = Checkpoint(ckpt).config
    config = official_config(cfg)
    config.get_text_config()._attn_implementation = "eager"
    module, cls, _, _ = MODELS[cfg.family]
    main = getattr(importlib.import_module(module), cls)(config).float()
    tensors = load_file(ckpt / "model.safetensors")
    spec = FAMILIES[cfg.family]
    main.get_input_embeddings().weight.data = tensors[spec.main_model_prefixes[0] + spec.embedding].float()
    main.lm_head.weight.data = tensors[spec.lm_head].float()
    main.config.name_or_path, main.config.dtype = str(ckpt), torch.float32
    return main, MtpModel.from_pretrained(main, device_map={"": "cpu"}).float().eval()


def depth_rows(f, depth: int, stage: str) -> np.ndarray:
    return f[f"stages/{stage}"][:] if depth == 1 else f[f"chain/d{depth}/stages/{stage}"][:]


def test_every_depth_equals_mtp_model_forward_drafting_with_its_own_cache(chained):
    from transformers.cache_utils import MtpCache

    _, ckpt, trace = chained
    main, mtp = official_mtp_model(ckpt)
    outs, forward_layer = {}, mtp.forward_layer

    def recorded(layer_idx, *args, **kwargs):  # what MtpModel recycles: after the shared norm where it has one
        outs[layer_idx] = forward_layer(layer_idx, *args, **kwargs)[0]
        return outs[layer_idx][None]

    mtp.forward_layer = recorded
    with h5py.File(trace) as f, torch.no_grad():
        ids, hidden, positions = (torch.from_numpy(f[f"inputs/{k}"][:])[None] for k in
                                  ("token_ids", "hidden", "positions"))
        drafts, _, _ = mtp(input_ids=ids, last_hidden_states=hidden, attention_mask=None, position_ids=positions,
                           mtp_cache=MtpCache(config=main.config.get_mtp_config()))
        assert json.loads(f.attrs["chain"])["layers"] == list(range(1, len(mtp.layers)))
        steps = ids.shape[1]
        for layer in range(len(mtp.layers)):
            # MtpModel's layer l row s reads token_ids[s + l] (teacher-forced) while s + l < T: depth l+1's rows
            ref, n = depth_rows(f, layer + 1, "out"), steps - layer
            official = outs[layer][:n].numpy()
            np.testing.assert_allclose(official, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=f"layer {layer}")
            if layer:
                np.testing.assert_array_equal(f[f"chain/d{layer + 1}/inputs/layer"][:], layer)
                # twin: the comparison tells layers apart (the previous layer's output is not this one's)
                assert np.abs(outs[layer - 1][:n].numpy() - ref).max() > 1e-2
        # MtpModel's first draft (layer 0 at the last step) is the trace's depth-1 draft there
        assert int(drafts[0, 0]) == int(f["stages/draft"][-1, 0])


def test_a_candidate_reusing_layer0_at_depth2_differs_from_the_reference_there(chained):
    """The oracle side of `layer0_reused`: depth 2 run on layer 0 (vLLM without spec_step_idx) gives other rows
    from the first stage on (enorm is per layer), so a candidate that does it diverges at depth 2."""
    _, ckpt, trace = chained
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    with h5py.File(trace) as f, torch.no_grad():
        d2 = {k: torch.from_numpy(f[f"chain/d2/inputs/{k}"][:]) for k in ("embed", "recycled", "positions")}
        mask = impl.layer_mask(d2["positions"], head.window(1))
        for layer, same in ((1, True), (0, False)):
            rows = head.steps(rotary, d2["embed"][None], d2["recycled"][None], d2["positions"][None], mask,
                              head.pass_cache(), layer=layer)
            ref = f["chain/d2/stages/out"][:]
            close = np.abs(rows["out"][0].numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
            assert close == same, layer
            assert (np.abs(rows["e"][0].numpy() - f["chain/d2/stages/e"][:]).max() == 0) == same


def test_a_perturbation_of_each_stage_is_first_seen_at_that_stage_at_every_depth(chained, tmp_path):
    """Each depth's rows as a one-depth trace (inputs of that depth, its stages): a perturbation of stage k and
    everything after is first seen at k, at every depth (every stage is captured per depth, not carried over)."""
    _, ckpt, trace = chained
    vocab = Checkpoint(ckpt).config.vocab_size
    with read_trace(trace) as t:
        order, stage_list, dims = t.stages, t.stage_list, t.dims
    with h5py.File(trace) as f:
        depths = range(2, json.loads(f.attrs["chain"])["depths"] + 1)
        for depth in depths:
            g = f[f"chain/d{depth}"]
            inputs = TraceInputs(token_ids=g["inputs/token_ids"][:], positions=g["inputs/positions"][:],
                                 hidden=g["inputs/recycled"][:], embed=g["inputs/embed"][:])
            stages = {name: g[f"stages/{name}"][:] for name in order}
            ref = tmp_path / f"d{depth}.h5"
            write_trace(ref, inputs, stages, {"producer": "test"}, stage_list=stage_list, dims=dims)
            for k, stage in enumerate(order[::3] + (order[-1],)):
                at = order.index(stage)
                cand = {}
                for name in order:
                    rows = stages[name].copy()
                    if order.index(name) >= at:
                        if name == "draft":
                            rows = (rows + 1) % vocab
                        elif rows.dtype.kind == "i":
                            experts = stages["router_logits"].shape[1]
                            for row in rows:
                                row[0] = next(e for e in range(experts) if e not in row)
                        else:
                            rows = (rows + 0.01 * np.abs(rows).max() + 0.01).astype(np.float32)
                    cand[name] = rows
                path = tmp_path / f"d{depth}_{stage}.h5"
                write_trace(path, inputs, cand, {"producer": "test"}, stage_list=stage_list, dims=dims)
                report = diff_traces(ref, path)
                assert report.first is not None and report.first.stage == stage, (depth, stage, report.first)


# where each family's config.json holds the MTP layer count (Inkling's release: a top-level mtp_config)
COUNT_KEY = {"step3p7": ("text_config", "num_nextn_predict_layers"), "inkling": ("mtp_config", "num_nextn_predict_layers")}


def _with_config(ckpt, out, block="text_config", **text):
    out.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    config[block].update(text)
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_layer_count_disagreeing_with_the_tensors_exits_2_naming_both(family, tmp_path):
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", family)
    cfg = Checkpoint(ckpt).config
    block, key = COUNT_KEY[family]
    n, first = cfg.num_mtp_layers, 0 if cfg.mtp_prefix else cfg.num_hidden_layers  # the checkpoint's layer 0
    cases = {"fewer": (n - 1, f"extra [{first + n - 1}]"), "more": (n + 1, f"missing [{first + n}]")}
    for case, (count, named) in cases.items():
        bad = _with_config(ckpt, tmp_path / case, block, **{key: count})
        result = run_cli(oracle_cli, ["export", bad, "--out", tmp_path / f"{case}.h5", "--tokens", "5,6",
                                      "--hidden-seed", "0"])
        assert result.exit_code == 2, result.output
        assert f"declares {count} MTP layer" in result.output and named in result.output, result.output
        assert f"config.json: {'mtp_config.' + key if block == 'mtp_config' else key} = {count}" in result.output
    absent = _with_config(ckpt, tmp_path / "absent", block, **{key: None})  # the silent-drop case: no count at all
    result = run_cli(oracle_cli, ["export", absent, "--out", tmp_path / "a.h5", "--tokens", "5,6",
                                  "--hidden-seed", "0"])
    assert result.exit_code == 2 and key in result.output, result.output
    good = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "ok.h5", "--tokens", "5,6", "--hidden-seed", "0"])
    assert good.exit_code == 0, good.output  # twin: the count the tensors hold is accepted


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_chain_deeper_than_the_layers_exits_2_unless_modulo(family, tmp_path):
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", family)
    n = Checkpoint(ckpt).config.num_mtp_layers
    args = ["export", ckpt, "--tokens", TOKENS, "--hidden-seed", "0", "--chain", str(n + 2), "-q"]
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "deep.h5"])
    assert result.exit_code == 2 and f"at most {n}" in result.output and "modulo" in result.output, result.output
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "mod.h5", "--chain-layers", "modulo"])
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "mod.h5") as f:
        chain = json.loads(f.attrs["chain"])
        assert chain["layers"] == [(j - 1) % n for j in range(2, n + 3)] and chain["num_layers"] == n
        assert "spec_step_idx" in chain["layer_convention"]
        wrapped = n + 1  # depth N+1 runs layer 0 again: its rows equal layer 0 run on that depth's inputs
        np.testing.assert_array_equal(f[f"chain/d{wrapped}/inputs/layer"][:], 0)


def test_the_mtp_model_families_are_registered():
    assert set(FAMILY_NAMES) <= set(FAMILIES)


def test_accept_drafts_equal_mtp_model_forward_on_every_prefix(chained):
    """accept's argmax chains on an N-layer head (alpha_j per depth): chain c's drafts are what MtpModel.forward
    drafts from the prefix 0..c through a fresh MtpCache (layer l: teacher-forced rows of the bridges before c, the
    chain's own draft at c); twin: a chain drafted with layer 0 at every depth differs somewhere."""
    from transformers.cache_utils import MtpCache

    from oracle.accept import draft_chains

    _, ckpt, _ = chained
    checkpoint = Checkpoint(ckpt)
    cfg = checkpoint.config
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(cfg, impl.torch_weights(checkpoint.read_head(widen=False)))
    k = cfg.num_mtp_layers
    rng = np.random.default_rng(3)
    sequence = rng.integers(0, cfg.vocab_size, 12 + k)
    hidden = rng.standard_normal((len(sequence), cfg.hidden_size)).astype(np.float32)
    drafts, _ = draft_chains(checkpoint, head, rotary, sequence, hidden, k)
    main, mtp = official_mtp_model(ckpt)
    with torch.no_grad():
        for c in range(len(drafts)):
            ids = torch.from_numpy(sequence[1:c + 2])[None]
            official, _, _ = mtp(input_ids=ids, last_hidden_states=torch.from_numpy(hidden[:c + 1])[None],
                                 attention_mask=None, position_ids=torch.arange(c + 1)[None],
                                 mtp_cache=MtpCache(config=main.config.get_mtp_config()))
            np.testing.assert_array_equal(drafts[c], official[0].numpy(), err_msg=f"chain {c}")
    layers = head.mtp.layers
    reused = torch.nn.ModuleList([layers[0]] + [copy.deepcopy(layers[0]) for _ in range(1, len(layers))])
    for index, layer in enumerate(reused):  # layer 0's weights at every depth, each copy in its own cache slot
        layer.mtp_block.self_attn.layer_idx = index
    head.mtp.layers = reused
    try:
        wrong, _ = draft_chains(checkpoint, head, rotary, sequence, hidden, k)
    finally:
        head.mtp.layers = layers
    np.testing.assert_array_equal(wrong[:, 0], drafts[:, 0])  # depth 1 runs layer 0 either way
    assert (wrong[:, 1:] != drafts[:, 1:]).any()
