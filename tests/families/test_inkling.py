"""Inkling on transformers' MtpModel (issue 25): what this family adds to the mtp_model pair, each with a twin that
must fail. The shared checks (equality with `MtpModel.from_pretrained` + `forward` at every depth at held-out dims,
stepwise = batched, strict loading, the layer-count refusal, stage-first-seen at every depth, layer 0 reused) run in
tests/families/test_mtp_model_families.py and test_family_contract.py.

- concat order [h, e] (`mtp_hidden_states_first`): the other order is first seen at fc_in;
- positions from the cache as MtpCache counts them (layer l's row r at r + l + 1): a plain cache's are not;
- the draft logits: lm_head(out / logits_mup_width_multiplier) over the unpadded vocabulary, as MtpModel drafts;
- argmax chains: each chain's own rows run apart (their own conv states), as MtpModel.forward on the prefix;
- sliding-window MTP layers are refused (exit 2): transformers' batched and stepwise MtpModel disagree on them."""

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.families.registry import FAMILIES, head_module
from tests.helpers import load_script, run_cli

FIXTURES = load_script("make_fixtures")
TOKENS = "5,17,3,99,200,7,42,5,61,9"
SPEC = FAMILIES["inkling"]


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    """(checkpoint, batched trace, head, rotary) of the tiny Inkling."""
    root = tmp_path_factory.mktemp("inkling")
    ckpt = FIXTURES.write_mtp_model_checkpoint(root / "ckpt", "inkling")
    out = root / "ref.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0", "-q"])
    assert result.exit_code == 0, result.output
    checkpoint = Checkpoint(ckpt)
    impl = head_module(checkpoint.family)
    head, rotary = impl.build_head(checkpoint.config, impl.torch_weights(checkpoint.read_head(widen=False)))
    return ckpt, out, head, rotary


def _depth1(trace):
    with h5py.File(trace) as f:
        inputs = {k: torch.from_numpy(f[f"inputs/{k}"][:])[None] for k in ("embed", "hidden", "positions")}
        stages = {k: f[f"stages/{k}"][:] for k in f["stages"]}
    return inputs, stages


def _run(head, rotary, inputs, cache):
    from oracle.families.mtp_model import layer_mask

    mask = layer_mask(inputs["positions"][0], head.window(0))
    with torch.no_grad():
        return {k: v[0].numpy() for k, v in head.steps(rotary, inputs["embed"], inputs["hidden"],
                                                        inputs["positions"], mask, cache).items()}


def _close(a, b) -> bool:
    return np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_the_concat_order_is_hidden_first_and_the_other_order_is_first_seen_at_fc_in(inkling):
    _, trace, head, rotary = inkling
    inputs, ref = _depth1(trace)
    same = _run(head, rotary, inputs, head.pass_cache())
    assert all(_close(same[k], ref[k]) for k in ("e", "h", "fc_in", "fc", "out"))
    d = ref["e"].shape[1]
    np.testing.assert_array_equal(ref["fc_in"][:, :d], ref["h"])  # [h, e]: hnorm's rows first
    head.text_config.mtp_hidden_states_first = False  # the config every MtpLayer reads at each forward
    try:
        swapped = _run(head, rotary, inputs, head.pass_cache())
    finally:
        head.text_config.mtp_hidden_states_first = True
    assert _close(swapped["e"], ref["e"]) and _close(swapped["h"], ref["h"])  # twin: nothing before fc_in moves
    assert not _close(swapped["fc_in"], ref["fc_in"]) and not _close(swapped["fc"], ref["fc"])


def test_positions_come_from_the_mtp_cache_offsets_and_a_plain_cache_differs(inkling):
    """Inkling's attention reads no position ids: its relative logits take query and key positions from the
    cache, and its log-scaled logits the query's absolute one (MtpCache: layer l's row r at r + l + 1). The
    oracle runs through MtpCache, as MtpModel.forward; a plain cache (offset 0) changes attn."""
    from transformers import DynamicCache

    _, trace, head, rotary = inkling
    inputs, ref = _depth1(trace)
    assert _close(_run(head, rotary, inputs, head.pass_cache())["attn"], ref["attn"])
    plain = _run(head, rotary, inputs, DynamicCache(config=head.text_config))
    assert _close(plain["ah"], ref["ah"]) and not _close(plain["attn"], ref["attn"])
    shifted = dict(inputs, positions=inputs["positions"] + 7)  # position ids are not read: unchanged
    assert _close(_run(head, rotary, shifted, head.pass_cache())["attn"], ref["attn"])


def _official_logits(ckpt, head, out_rows: np.ndarray) -> torch.Tensor:
    """MtpModel._project_to_logits over the checkpoint's lm_head: muP scaling and the unpadded slice."""
    head.mtp.shared_head = torch.nn.Linear(out_rows.shape[1], 1, bias=False)
    head.mtp.shared_head.weight = torch.nn.Parameter(load_file(ckpt / "model.safetensors")[SPEC.lm_head].float())
    with torch.no_grad():
        return head.mtp._project_to_logits(torch.from_numpy(out_rows))


def test_drafts_are_mup_scaled_and_sliced_to_the_unpadded_vocabulary(inkling, tmp_path):
    ckpt, _, head, _ = inkling
    cfg = Checkpoint(ckpt).config
    # padded rows that would win every argmax: a draft projection without the slice picks them
    padded = tmp_path / "padded"
    padded.mkdir()
    (padded / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    tensors[SPEC.lm_head][cfg.draft_vocab_size:] *= 50
    save_file(tensors, padded / "model.safetensors", metadata={"format": "pt"})
    trace = tmp_path / "padded.h5"
    result = run_cli(oracle_cli, ["export", padded, "--out", trace, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", "3", "-q"])
    assert result.exit_code == 0, result.output
    with h5py.File(trace) as f:
        for group in ("", "chain/d2/", "chain/d3/"):
            out, draft = f[f"{group}stages/out"][:], f[f"{group}stages/draft"][:, 0]
            margin = f[f"{group}evidence/draft_margin"][:, 0]
            logits = _official_logits(padded, head, out)
            assert logits.shape[-1] == cfg.draft_vocab_size
            np.testing.assert_array_equal(draft, logits.argmax(-1).numpy())
            top2 = torch.topk(logits.double(), 2).values
            np.testing.assert_allclose(margin, (top2[:, 0] - top2[:, 1]).numpy(), rtol=1e-4, atol=1e-6)
            # twins: the unsliced argmax is a padded id; the unscaled margin is the multiplier times larger
            unsliced = torch.from_numpy(out).double() @ tensors[SPEC.lm_head].double().T
            assert (unsliced.argmax(-1) >= cfg.draft_vocab_size).all()
            unscaled = torch.topk(unsliced[:, : cfg.draft_vocab_size], 2).values
            assert not np.allclose(margin, (unscaled[:, 0] - unscaled[:, 1]).numpy(), rtol=1e-2)
        norm_max = f["evidence/draft_margin"].attrs["row_norm_max"]
    rows = tensors[SPEC.lm_head][: cfg.draft_vocab_size].float()
    assert norm_max >= float(rows.norm(dim=1).max()) / cfg.logits_divisor > norm_max * 0.99


def test_argmax_chains_equal_mtp_model_forward_on_each_prefix(inkling, tmp_path):
    """export --chain-tokens argmax: chain c's depth-j rows are MtpModel.forward's layer j-1 at the last row of
    the prefix 0..c through a fresh MtpCache (each chain its own conv states: run apart, not batched); twin: the
    teacher-forced chains' rows differ from depth 2 on."""
    from transformers.cache_utils import MtpCache

    import tests.families.test_mtp_model_families as shared

    ckpt, _, head, _ = inkling
    out = tmp_path / "argmax.h5"
    args = ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0", "--chain", "3",
            "--chain-tokens", "argmax", "-q"]
    result = run_cli(oracle_cli, args)
    assert result.exit_code == 0, result.output
    main, mtp = shared.official_mtp_model(ckpt)
    outs, forward_layer = {}, mtp.forward_layer

    def recorded(layer_idx, *a, **k):
        outs[layer_idx] = forward_layer(layer_idx, *a, **k)[0]
        return outs[layer_idx][None]

    mtp.forward_layer = recorded
    with h5py.File(out) as f, torch.no_grad():
        ids, hidden = (torch.from_numpy(f[f"inputs/{k}"][:])[None] for k in ("token_ids", "hidden"))
        for c in range(len(f["chain/d3/stages/out"])):
            mtp(input_ids=ids[:, :c + 1], last_hidden_states=hidden[:, :c + 1], attention_mask=None,
                position_ids=torch.arange(c + 1)[None], mtp_cache=MtpCache(config=main.config.get_mtp_config()))
            for depth in (2, 3):
                ref = f[f"chain/d{depth}/stages/out"][c]
                assert _close(outs[depth - 1][-1].numpy(), ref), (c, depth)
    # twin: the argmax rows are not the teacher-forced ones (the comparison above would tell them apart)
    teacher = tmp_path / "teacher.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", teacher, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", "3", "-q"])
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f, h5py.File(teacher) as g:
        assert not _close(f["chain/d3/stages/out"][:], g["chain/d3/stages/out"][:])
        np.testing.assert_array_equal(f["stages/out"][:], g["stages/out"][:])  # depth 1 is the same pass


def test_sliding_window_mtp_layers_are_refused_with_exit_2_and_full_ones_accepted(tmp_path):
    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "inkling")
    import json

    config = json.loads((ckpt / "config.json").read_text())
    config["mtp_config"]["local_layer_ids"] = [1]
    (ckpt / "config.json").write_text(json.dumps(config))
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "s.h5", "--tokens", "5,6", "--hidden-seed", "0"])
    assert result.exit_code == 2 and "local_layer_ids" in result.output and "[1]" in result.output, result.output
    config["mtp_config"]["local_layer_ids"] = []  # twin: no sliding layer is accepted
    (ckpt / "config.json").write_text(json.dumps(config))
    result = run_cli(oracle_cli, ["export", ckpt, "--out", tmp_path / "f.h5", "--tokens", "5,6", "--hidden-seed", "0"])
    assert result.exit_code == 0, result.output


def test_without_the_chain_norm_the_layer_output_is_recycled_and_equals_mtp_model_forward(tmp_path):
    """chain_hidden_post_norm false: MtpModel applies no norm after a layer; `out` is res2 at every depth."""
    import tests.families.test_mtp_model_families as shared

    ckpt = FIXTURES.write_mtp_model_checkpoint(tmp_path / "ckpt", "inkling", {"chain_hidden_post_norm": False})
    out = tmp_path / "chain.h5"
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", TOKENS, "--hidden-seed", "0",
                                  "--chain", "3", "-q"])
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        for group in ("", "chain/d2/", "chain/d3/"):
            np.testing.assert_array_equal(f[f"{group}stages/out"][:], f[f"{group}stages/res2"][:])
    shared.test_every_depth_equals_mtp_model_forward_drafting_with_its_own_cache(("inkling", ckpt, out))
