"""Qwen3.5 dense heads with several MTP layers (`mtp_num_hidden_layers` N > 1; issue 25).

vLLM's Qwen3_5MultiTokenPredictor (and Qwen3-Next's) holds one stem (pre_fc_norm_embedding, pre_fc_norm_hidden,
fc), N decoder layers `mtp.layers.{l}` and one final norm; the step at depth j runs layer j-1 between the shared
stem and the shared norm, each layer over its own KV cache. The independent reference here is written from the
checkpoint's own files: the official transformers Qwen3_5DecoderLayer per layer (loaded strictly from
`mtp.layers.{l}.*`), its official rotary, a plain-torch (1 + w) RMSNorm stem and final norm, and one DynamicCache
per layer, stepped one token at a time in the engine's order (bridge c on layer 0, then its chain: depth j on layer
j-1, the previous depth's normed out recycled, position p_c + j - 1; no cache is ever cropped). The oracle's loop,
its head and its variants are never used to build it.

Twins: layer 0 at depth 2 gives other rows; the probe names `layer0_reused` on engine-shaped candidates
(`layer_caches_swapped` on fixtures/qwen3_5_tiny_3layer: tests/probe/test_explain_loop_layers.py) and passes the
correct engine; `shared_head_shared` says why it cannot apply (one final
norm by design). Bad input: a layer count that disagrees with the tensors, none at all with two layers held,
num_nextn_predict_layers disagreeing, a MoE head with N > 1, and `--chain` deeper than N without modulo, all exit 2.
"""

import json

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding

from oracle.checkpoint import Checkpoint
from oracle.cli import cli as oracle_cli
from oracle.export import ChainOptions, HiddenSource, export_trace
from tests.helpers import load_script, run_cli
from tests.probe.test_explain_loop import diagnosis, explained, layered_engine, named
from tests.probe.test_explain_loop_layers import _dump, stepwise_engine
from tests.probe.tracekit import diff_cli, last_line, load_trace

F = load_script("make_fixtures")
# held-out dims: no fixture uses them (4 MTP layers, 6 heads over 2 KV heads of 16, half-rotary mrope)
HELD_OUT = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 80, "vocab_size": 300, "num_hidden_layers": 4, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mtp_num_hidden_layers": 4}
TOKENS = np.array([5, 17, 3, 99, 200, 7, 42, 5, 61, 9, 250, 1])
START = 3  # positions from 3: a chain position is not its row
STAGES = ("e", "h", "fc_in", "fc", "ah", "attn", "res1", "mh", "mlp", "res2", "out")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """(checkpoint, `export --chain 4` trace) of a held-out 4-layer head."""
    root = tmp_path_factory.mktemp("qwen-n-layer")
    ckpt = F.write_checkpoint(root / "ckpt", HELD_OUT, seed=3)
    trace = export_trace(ckpt, root / "ref.h5", TOKENS, HiddenSource(seed=2), start_pos=START, chain=ChainOptions(4))
    return ckpt, trace


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w), in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


class OfficialEngine:
    """The checkpoint's head as an engine runs it, one token at a time (module docstring). `layer_of(j)`: the layer
    depth j runs (the correct engine: j - 1)."""

    def __init__(self, ckpt_dir):
        raw = json.loads((ckpt_dir / "config.json").read_text())["text_config"]
        n = raw["mtp_num_hidden_layers"]
        text = Qwen3_5TextConfig(**{**raw, "num_hidden_layers": n, "layer_types": ["full_attention"] * n})
        text._attn_implementation = "eager"  # one query over its own cache: no mask needed
        t = {k: v.float() for k, v in load_file(ckpt_dir / "model.safetensors").items()}
        self.t, self.eps = t, text.rms_norm_eps
        self.layers = []
        for i in range(n):
            layer = Qwen3_5DecoderLayer(text, layer_idx=i)
            prefix = f"mtp.layers.{i}."
            layer.load_state_dict({k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)},
                                  strict=True)
            self.layers.append(layer.eval())
        self.rotary = Qwen3_5TextRotaryEmbedding(config=text)
        self.embed = t["model.language_model.embed_tokens.weight"]
        self.lm_head = t["lm_head.weight"].double()

    @torch.inference_mode()
    def step(self, layer: int, token: int, hidden: torch.Tensor, position: int, cache: DynamicCache) -> dict:
        t, s = self.t, {}
        s["e"] = _norm(self.embed[token][None, None], t["mtp.pre_fc_norm_embedding.weight"], self.eps)
        s["h"] = _norm(hidden.reshape(1, 1, -1), t["mtp.pre_fc_norm_hidden.weight"], self.eps)
        s["fc_in"] = torch.cat([s["e"], s["h"]], dim=-1)
        s["fc"] = s["fc_in"] @ t["mtp.fc.weight"].T
        block = self.layers[layer]
        hooks = [block.input_layernorm.register_forward_hook(lambda m, i, o: s.__setitem__("ah", o)),
                 block.self_attn.register_forward_hook(lambda m, i, o: s.__setitem__("attn", o[0])),
                 block.post_attention_layernorm.register_forward_pre_hook(lambda m, i: s.__setitem__("res1", i[0])),
                 block.post_attention_layernorm.register_forward_hook(lambda m, i, o: s.__setitem__("mh", o)),
                 block.mlp.register_forward_hook(lambda m, i, o: s.__setitem__("mlp", o))]
        try:
            p = torch.tensor([[position]])
            s["res2"] = block(s["fc"], position_embeddings=self.rotary(s["fc"], p), cache=cache)
        finally:
            for hook in hooks:
                hook.remove()
        s["out"] = _norm(s["res2"], t["mtp.norm.weight"], self.eps)
        rows = {k: v.reshape(-1).numpy().copy() for k, v in s.items()}
        rows["draft"] = int(np.argmax(self.lm_head.numpy() @ rows["out"].astype(np.float64)))
        return rows

    def run(self, tokens, hidden, positions, depths: int, layer_of=lambda j: j - 1,
            fed: dict | None = None) -> dict[int, list[dict]]:
        """{depth: [rows of each bridge c that has that depth]}: bridge c, its chain, then bridge c + 1. Layer 0's
        cache is cut back to the bridge entries before each bridge step (vLLM's slots for the draft positions are
        overwritten): a no-op for the correct engine, whose chains never run layer 0; with `layer_of` = 0 this is
        layer0_reused as vLLM runs it. `fed`: {depth j: the token ids (n_j,) chain c is fed there} (an argmax
        reference's recorded drafts), else teacher-forced x_{c+j}."""
        caches = [DynamicCache() for _ in self.layers]  # one per layer; layers >= 1 never cropped
        found = {j: [] for j in range(1, depths + 1)}
        for c in range(len(tokens)):
            extra = caches[0].get_seq_length() - c  # the previous chain's entries in layer 0
            if extra > 0:
                caches[0].crop(-extra)
            row = self.step(0, int(tokens[c]), torch.from_numpy(hidden[c]), int(positions[c]), caches[0])
            found[1].append(row)
            for j in range(2, depths + 1):
                if c + j - 1 >= len(tokens):
                    break
                layer = layer_of(j)
                token = int(fed[j][c]) if fed is not None else int(tokens[c + j - 1])
                row = self.step(layer, token, torch.from_numpy(row["out"]),
                                int(positions[c]) + j - 1, caches[layer])
                found[j].append(row)
        return found


def _rows(f, depth: int, stage: str) -> np.ndarray:
    return f[f"stages/{stage}" if depth == 1 else f"chain/d{depth}/stages/{stage}"][:]


def test_every_depth_equals_official_layers_stepped_in_the_engines_order(held_out):
    ckpt, trace = held_out
    engine = OfficialEngine(ckpt)
    with h5py.File(trace) as f:
        chain = json.loads(f.attrs["chain"])
        assert chain["layers"] == [1, 2, 3] and chain["num_layers"] == 4, chain
        assert chain["kv"] == "per_layer_teacher_forced", chain
        tokens, hidden, positions = (f[f"inputs/{k}"][:] for k in ("token_ids", "hidden", "positions"))
        found = engine.run(tokens, hidden, positions, 4)
        for depth, rows in found.items():
            assert len(rows) == len(TOKENS) - depth + 1
            for stage in STAGES:
                ref = _rows(f, depth, stage)
                official = np.stack([r[stage] for r in rows])
                np.testing.assert_allclose(official, ref, rtol=0, atol=2e-6 * np.abs(ref).max(),
                                           err_msg=f"depth {depth} {stage}")
            assert [r["draft"] for r in rows] == _rows(f, depth, "draft")[:, 0].tolist(), depth
            if depth > 1:
                np.testing.assert_array_equal(f[f"chain/d{depth}/inputs/layer"][:], depth - 1)
        # twin: the comparison tells layers apart (layer 0 at depth 2 gives other rows from `ah` on)
        reused = engine.run(tokens, hidden, positions, 2, layer_of=lambda j: 0)[2]
        ref = _rows(f, 2, "ah")
        assert np.abs(np.stack([r["ah"] for r in reused]) - ref).max() > 1e-2 * np.abs(ref).max()
        # ... and not before: bridge 0's depth-2 stem is the same
        np.testing.assert_allclose(reused[0]["fc"], _rows(f, 2, "fc")[0], rtol=0, atol=1e-6)


def test_every_layer_is_read_from_its_own_tensors(held_out):
    """The head holds N layers loaded from their own names: no two layers' attention weights are equal."""
    from oracle.families.registry import head_module

    ckpt = Checkpoint(held_out[0])
    impl = head_module(ckpt.family)
    head, _ = impl.build_head(ckpt.config, impl.torch_weights(ckpt.read_head(widen=False)))
    assert head.num_layers == ckpt.family.layer_count(ckpt.config) == 4
    stored = load_file(held_out[0] / "model.safetensors")
    for i, layer in enumerate(head.layers):
        np.testing.assert_array_equal(layer.self_attn.k_proj.weight.float().numpy(),
                                      stored[f"mtp.layers.{i}.self_attn.k_proj.weight"].float().numpy())


# ---- the probe on engine-shaped candidates ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """(checkpoint with 3 MTP layers, its `export --chain 3` of 10 tokens)."""
    root = tmp_path_factory.mktemp("qwen-3-layer")
    ckpt = F.write_checkpoint(root / "ckpt", {"mtp_num_hidden_layers": 3})
    return ckpt, export_trace(ckpt, root / "ref.h5", TOKENS[:10], HiddenSource(seed=0), chain=ChainOptions(3))


def test_layer0_reused_is_caught_at_depth_2_ah_and_named(tiny3, tmp_path):
    """The stem is shared, so e..fc match at depth 2; layer 0's input_layernorm gives another `ah`."""
    ckpt, ref = tiny3
    inputs, _ = load_trace(ref)
    result, report = explained(ref, _dump(ref, tmp_path, *layered_engine(ckpt, inputs, 3, lambda j: 0)), tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: ah at depth 2 bridge 0" in last_line(result), result.output
    assert named(report)[:1] == ["layer0_reused"], diagnosis(result)
    statuses = {v["variant"]: (v["status"], v.get("reason", "")) for v in report["variants"]}
    assert statuses["shared_head_shared"] == ("not applicable", "the head has one final norm (mtp.norm) shared by "
                                                                "every layer by design")
    assert statuses["chain_kv_kept"][0] == "not applicable"


def _official_dump(ckpt, ref, tmp_path, name, layer_of):
    """The independent OfficialEngine's rows as a raw candidate dump (depths 1..3)."""
    inputs, _ = load_trace(ref)
    found = OfficialEngine(ckpt).run(inputs.token_ids, inputs.hidden, inputs.positions, 3, layer_of=layer_of)
    parts = {j: {n: np.stack([np.atleast_1d(r[n]) for r in rows]).astype(np.int64 if n == "draft" else np.float32)
                 for n in rows[0]} for j, rows in found.items()}
    return _dump(ref, tmp_path, parts[1], {j: p for j, p in parts.items() if j > 1}, name=name)


def test_layer0_reused_as_vllm_runs_it_is_named_in_its_one_cache_form(tiny3, tmp_path):
    """The independent engine with layer 0 (and its one cache) at every depth: caught at depth 2 `ah`, named
    layer0_reused [one cache]; twin: the same engine with depth j on layer j-1 passes with no DIAGNOSIS."""
    ckpt, ref = tiny3
    result, report = explained(ref, _official_dump(ckpt, ref, tmp_path, "vllm", lambda j: 0), tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: ah at depth 2 bridge 0" in last_line(result), result.output
    assert diagnosis(result).startswith("DIAGNOSIS | layer0_reused [one cache] reproduces"), diagnosis(result)
    result, report = explained(ref, _official_dump(ckpt, ref, tmp_path, "right", lambda j: j - 1), tmp_path)
    assert result.exit_code == 0 and report["diagnosis"] == [], result.output


def test_twin_each_layer_at_its_own_depth_passes(tiny3, tmp_path):
    ckpt, ref = tiny3
    inputs, _ = load_trace(ref)
    for name, (one, chains) in {"batched": layered_engine(ckpt, inputs, 3, lambda j: j - 1),
                                "stepwise": stepwise_engine(ckpt, inputs, 3)}.items():
        result, report = explained(ref, _dump(ref, tmp_path, one, chains, name=name), tmp_path)
        assert result.exit_code == 0, (name, result.output)
        assert report["diagnosis"] == [], diagnosis(result)


def test_a_candidate_without_depths_is_inconclusive_on_a_chained_reference(tiny3, tmp_path):
    """Depth 1 alone matches, and the loop (layers 1 and 2) was never seen: never PASS."""
    from tests.probe.tracekit import write_raw

    ckpt, ref = tiny3
    inputs, stages = load_trace(ref)
    one, _ = layered_engine(ckpt, inputs, 1, lambda j: j - 1)
    result = diff_cli(ref, write_raw(tmp_path / "one", {n: one[n] for n in stages}))
    assert result.exit_code != 0 and "PASSED" not in last_line(result), result.output
    assert "INCONCLUSIVE" in result.output, result.output


# ---- bad input ------------------------------------------------------------------------------------------------------


def _with_text(ckpt, out, **text):
    out.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in text.items():
        if value is None:
            config["text_config"].pop(key, None)
        else:
            config["text_config"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    return out


def _export(ckpt, out, *extra):
    return run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", "5,6,7,8", "--hidden-seed", "0", "-q",
                                *extra])


def test_a_layer_count_disagreeing_with_the_tensors_exits_2_naming_both(tiny3, tmp_path):
    ckpt, _ = tiny3
    for case, count, named in (("fewer", 2, "extra mtp.layers.2.*"), ("more", 4, "missing mtp.layers.3.*")):
        bad = _with_text(ckpt, tmp_path / case, mtp_num_hidden_layers=count)
        result = _export(bad, tmp_path / f"{case}.h5")
        assert result.exit_code == 2, result.output
        assert f"mtp_num_hidden_layers = {count}" in result.output and "holds MTP layer(s) 0, 1, 2" in result.output
        assert named in result.output, result.output
        assert "Traceback" not in result.output
        assert not (tmp_path / f"{case}.h5").exists()
    absent = _with_text(ckpt, tmp_path / "absent", mtp_num_hidden_layers=None)  # the silent-drop case
    result = _export(absent, tmp_path / "a.h5")
    assert result.exit_code == 2 and "1 where the key is absent" in result.output, result.output
    assert "extra mtp.layers.1.*, mtp.layers.2.*" in result.output, result.output
    nextn = _with_text(ckpt, tmp_path / "nextn", num_nextn_predict_layers=2)
    result = _export(nextn, tmp_path / "n.h5")
    assert result.exit_code == 2 and "num_nextn_predict_layers" in result.output, result.output
    agreeing = _with_text(ckpt, tmp_path / "agree", num_nextn_predict_layers=3)
    assert _export(agreeing, tmp_path / "ok.h5").exit_code == 0  # twin: a count that agrees is read
    assert _export(ckpt, tmp_path / "ok2.h5").exit_code == 0


def test_a_one_layer_checkpoint_whose_config_claims_two_exits_2(tmp_path):
    from tests.helpers import TINY

    bad = _with_text(TINY, tmp_path / "two", mtp_num_hidden_layers=2)
    result = _export(bad, tmp_path / "t.h5")
    assert result.exit_code == 2 and "mtp_num_hidden_layers = 2" in result.output, result.output
    assert "missing mtp.layers.1.*" in result.output, result.output


def test_a_moe_head_with_several_layers_exits_2_saying_it_is_not_supported(tmp_path):
    ckpt = F.write_moe_checkpoint(tmp_path / "moe", "qwen3_5_moe", "per_expert", main_model=False)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 2
    (ckpt / "config.json").write_text(json.dumps(config))
    result = _export(ckpt, tmp_path / "m.h5")
    assert result.exit_code == 2 and "mtp_num_hidden_layers" in result.output, result.output
    assert "Traceback" not in result.output


def test_chain_deeper_than_the_layers_exits_2_unless_modulo(tiny3, tmp_path):
    ckpt, _ = tiny3
    args = ["export", ckpt, "--tokens", ",".join(map(str, TOKENS)), "--hidden-seed", "0", "--chain", "5", "-q"]
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "deep.h5"])
    assert result.exit_code == 2 and "at most 3" in result.output and "modulo" in result.output, result.output
    result = run_cli(oracle_cli, args + ["--out", tmp_path / "mod.h5", "--chain-layers", "modulo"])
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "mod.h5") as f:
        chain = json.loads(f.attrs["chain"])
        assert chain["layers"] == [1, 2, 0, 1] and chain["num_layers"] == 3, chain
        np.testing.assert_array_equal(f["chain/d4/inputs/layer"][:], 0)


def test_accept_measures_each_depth_on_its_own_layer(tiny3, tmp_path):
    """accept on the N-layer head (H from its own main model): alpha per depth through layer j-1 (k <= N), the
    report naming each depth's layer; --k past N exits 2."""
    ckpt, _ = tiny3
    sequence = ",".join(str(t) for t in np.random.default_rng(1).integers(0, 512, 24))
    out = tmp_path / "accept.json"
    result = run_cli(oracle_cli, ["accept", ckpt, "--tokens", sequence, "--k", "3", "--main-model", "--json", out])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["layers"] == [0, 1, 2]
    assert "depth 3 -> layer 2" in result.output or "layer 2" in result.output, result.output
    deep = run_cli(oracle_cli, ["accept", ckpt, "--tokens", sequence, "--k", "4", "--main-model"])
    assert deep.exit_code == 2 and "--k 3" in deep.output, deep.output


def test_enorm_hnorm_swap_on_an_n_layer_head_is_caught_at_depth_1_e_and_named(tiny3, tmp_path):
    """The bridge step's wiring variants (oracle/families/qwen3_5_explain.py) run on the N-layer head too."""
    ckpt, ref = tiny3
    inputs, _ = load_trace(ref)
    cand = _dump(ref, tmp_path, *layered_engine(ckpt, inputs, 3, lambda j: j - 1, swap_norms=True))
    result, report = explained(ref, cand, tmp_path)
    assert result.exit_code == 1, result.output
    assert "first divergent stage: e at token 0" in last_line(result), result.output  # depth 1: said as a token
    assert named(report)[:1] == ["enorm_hnorm_swap"], diagnosis(result)


def test_the_speedup_model_reads_the_stem_and_one_layer_per_depth(tiny3):
    """Each depth's draft step reads the shared stem and norm and its own layer, never the other layers: every
    layer's terms equal the one-layer head's of the same dims, and are the stem's bytes plus one layer's."""
    from oracle.speedup import head_draft_terms, stored_nbytes
    from tests.helpers import TINY

    ckpt = Checkpoint(tiny3[0])
    one = head_draft_terms(Checkpoint(TINY), "lm_head.weight", context=16)
    for depth_layer in range(3):
        terms = head_draft_terms(ckpt, "lm_head.weight", context=16, layer=depth_layer)
        assert terms.bytes == one.bytes and terms.flops == one.flops, depth_layer
    nbytes = stored_nbytes(ckpt)
    stem = sum(nbytes(n) for n in ckpt.names() if n.startswith("mtp.") and not n.startswith("mtp.layers."))
    layer = sum(nbytes(n) for n in ckpt.names() if n.startswith("mtp.layers.1."))
    assert terms.bytes["head layer (dense tensors)"] == stem + layer  # not the 3 layers' stem + 3 * layer


def test_gguf_of_an_n_layer_head_exits_2_instead_of_dropping_layers(tiny3, tmp_path):
    from tests.helpers import TINY

    result = run_cli(oracle_cli, ["gguf", tiny3[0], "--out", tmp_path / "h.gguf"])
    assert result.exit_code == 2 and "3 MTP layers" in result.output, result.output
    assert not (tmp_path / "h.gguf").exists()
    assert run_cli(oracle_cli, ["gguf", TINY, "--out", tmp_path / "one.gguf"]).exit_code == 0  # twin: one layer


# ---- argmax chains: the two conventions for what each layer's cache holds -----------------------------------------


def _argmax_export(ckpt, out, *kv, depths=4):
    result = run_cli(oracle_cli, ["export", ckpt, "--out", out, "--tokens", ",".join(map(str, TOKENS)),
                                  "--hidden-seed", "2", "--start-pos", "3", "--chain", str(depths), "--chain-tokens",
                                  "argmax", "-q", *kv])
    assert result.exit_code == 0, result.output
    return out


def _fed(f, depths):
    return {j: f[f"chain/d{j}/inputs/token_ids"][:] for j in range(2, depths + 1)}


def test_engine_order_argmax_chains_equal_the_official_engine_fed_their_drafts(held_out, tmp_path):
    """--chain-kv engine: every depth equals the independent engine stepping bridge c then its chain, each layer
    keeping the entries its depth's chains wrote, fed the recorded drafts, which are the previous depth's argmax.
    Twin: the default (teacher-forced caches, MtpModel) reference differs from that engine at depth 2 past bridge 0
    and agrees at bridge 0 (no earlier chain), and --explain names the convention, not a bug."""
    ckpt, _ = held_out
    engine = OfficialEngine(ckpt)
    for kv, same in (("engine", True), ("teacher-forced", False)):
        trace = _argmax_export(ckpt, tmp_path / f"{kv}.h5", "--chain-kv", kv)
        with h5py.File(trace) as f:
            assert json.loads(f.attrs["chain"])["kv"] == ("per_layer_engine_order" if same else
                                                          "per_layer_teacher_forced")
            tokens, hidden, positions = (f[f"inputs/{k}"][:] for k in ("token_ids", "hidden", "positions"))
            fed = _fed(f, 4)
            for j in range(3, 5):  # argmax: depth j is fed depth j-1's draft
                np.testing.assert_array_equal(fed[j], _rows(f, j - 1, "draft")[:len(fed[j]), 0])
            found = engine.run(tokens, hidden, positions, 4, fed=fed)
            for depth in range(2, 5):
                ref = _rows(f, depth, "attn")
                official = np.stack([r["attn"] for r in found[depth]])
                close = np.abs(official - ref).max(axis=1) <= 2e-6 * np.abs(ref).max()
                assert close[0], (kv, depth)  # bridge 0's chain sees no earlier chain: the same either way
                assert close.all() == same, (kv, depth)
                if same:
                    for stage in STAGES:
                        ref = _rows(f, depth, stage)
                        np.testing.assert_allclose(np.stack([r[stage] for r in found[depth]]), ref, rtol=0,
                                                   atol=2e-6 * np.abs(ref).max(), err_msg=f"{depth} {stage}")
                    assert [r["draft"] for r in found[depth]] == _rows(f, depth, "draft")[:, 0].tolist()


def test_a_vllm_style_engine_on_a_teacher_forced_cache_reference_is_named_the_other_convention(tiny3, tmp_path):
    """The C candidate (engine order) on the default argmax reference: diverges at depth 2 `attn` bridge 1 and
    --explain names layer_caches_other_convention; on the --chain-kv engine reference it passes (twin)."""
    from probe.adapters.cabi import build_library
    from probe.cli import cli as probe_cli
    from tests.helpers import ROOT

    ckpt, _ = tiny3
    library = build_library(ROOT / "fixtures" / "candidates" / "mtp_step_v2.c", tmp_path)
    for kv, verdict in (("teacher-forced", 1), ("engine", 0)):
        ref = _argmax_export(ckpt, tmp_path / f"{kv}.h5", "--chain-kv", kv, depths=3)
        result = run_cli(probe_cli, ["run", ref, "--impl", f"c:{library}", "--explain", "--checkpoint", ckpt])
        assert result.exit_code == verdict, result.output
        if verdict:
            assert "first divergent stage: attn at depth 2 bridge 1" in last_line(result), result.output
            assert diagnosis(result).startswith("DIAGNOSIS | layer_caches_other_convention reproduces"), \
                diagnosis(result)


def test_chain_kv_engine_outside_n_layer_argmax_chains_exits_2(tiny3, tmp_path):
    from tests.helpers import TINY

    ckpt, _ = tiny3
    for where, extra in ((ckpt, []), (TINY, ["--chain-tokens", "argmax"])):
        result = run_cli(oracle_cli, ["export", where, "--out", tmp_path / "x.h5", "--tokens", "5,6,7", "--hidden-seed",
                                      "0", "--chain", "2", "--chain-kv", "engine", *extra])
        assert result.exit_code == 2 and "--chain-kv" in result.output and "Traceback" not in result.output, \
            result.output
        assert not (tmp_path / "x.h5").exists()


# ---- the layer choice is evidenced, never assumed ----------------------------------------------------------------


def test_layers_with_equal_weights_leave_the_layer_choice_unevidenced_never_passed(tiny3, tmp_path):
    """A head whose three layers hold layer 0's tensors: layer 0's weights at every depth give the same rows, so
    neither the correct engine nor one loading layer 0 into every layer may PASS (INCONCLUSIVE, saying why). Twin:
    on the head with distinct layers the correct engine passes, every out row evidencing its layer."""
    from safetensors.torch import save_file

    from probe.adapters.cabi import build_library
    from probe.cli import cli as probe_cli
    from tests.helpers import ROOT

    ckpt, ref = tiny3
    same = tmp_path / "same"
    same.mkdir()
    (same / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    for name in list(tensors):
        if name.startswith(("mtp.layers.1.", "mtp.layers.2.")):
            tensors[name] = tensors["mtp.layers.0." + name.split(".", 3)[3]].clone()
    save_file(tensors, same / "model.safetensors", metadata={"format": "pt"})
    same_ref = export_trace(same, tmp_path / "same.h5", TOKENS[:10], HiddenSource(seed=0), chain=ChainOptions(3))
    source = ROOT / "fixtures" / "candidates" / "mtp_step_v2.c"
    right, reused = build_library(source, tmp_path), build_library(source, tmp_path, ("MTP_MUTANT_LAYER0_REUSED",))
    result = run_cli(probe_cli, ["run", same_ref, "--impl", f"c:{right}"])
    assert result.exit_code == 3, result.output
    assert "depth 2: no out row evidences the layer choice" in last_line(result), result.output
    # layer 0's weights at every depth, each depth its own cache: the same rows, so not passed either
    inputs, _ = load_trace(same_ref)
    cand = _dump(same_ref, tmp_path, *layered_engine(same, inputs, 3, lambda j: 0), name="weights")
    result = diff_cli(same_ref, cand)
    assert result.exit_code == 3 and "no out row evidences the layer choice" in last_line(result), result.output
    # vLLM's form still shows: layer 0's one cache holds the bridge entries, which layer 1's never does
    result = run_cli(probe_cli, ["run", same_ref, "--impl", f"c:{reused}"])
    assert result.exit_code == 1 and "attn at depth 2 bridge 0" in last_line(result), result.output
    result = run_cli(probe_cli, ["run", ref, "--impl", f"c:{right}"])
    assert result.exit_code == 0, result.output
    assert "depth 2: layer choice vs layer 0: evidenced by 9 of 9 out rows" in result.output, result.output
