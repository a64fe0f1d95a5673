"""The export's attn_uniform evidence without a second attention run (oracle/attention_evidence.py): the means of
the visible value rows from prefix sums, the real pass's projections handed back, equal to the specification
(softmax over zeros plus the mask, every projection computed again) within float32 rounding, on every family's
tiny checkpoint (T=1, T=8 > V4's window of 4), and the probe's evidence decisions unchanged."""

from pathlib import Path

import numpy as np
import pytest
import torch

from oracle.attention_evidence import (reused_projections, specified_uniform_weights, uniform_attention,
                                       uniform_mean_attention)
from oracle.checkpoint import Checkpoint
from oracle.export import HiddenSource, export_trace
from oracle.families.registry import FAMILIES, head_module
from oracle.inputs import hidden_from_seed, positions_from_start
from oracle.trace import TraceInputs, read_trace
from probe.adapters.trace_file import open_reference
from probe.diff import qk_sensitivity
from probe.tolerance import DEFAULT
from tests.helpers import TINY, TINY_REF, load_script

FIXTURES = load_script("make_fixtures")
WRITERS = {
    "qwen3_5": FIXTURES.write_checkpoint,
    "qwen3_5_moe": lambda path: FIXTURES.write_moe_checkpoint(path, "qwen3_5_moe", "fused", main_model=False),
    "qwen3_next": lambda path: FIXTURES.write_moe_checkpoint(path, "qwen3_next", "per_expert", main_model=False),
    "deepseek_v3": lambda path: FIXTURES.write_mtp_layer_checkpoint(path, "deepseek_v3"),
    "glm4_moe": lambda path: FIXTURES.write_mtp_layer_checkpoint(path, "glm4_moe"),
    "deepseek_v4": lambda path: FIXTURES.write_deepseek_v4_checkpoint(path),
    "step3p7": lambda path: FIXTURES.write_mtp_model_checkpoint(path, "step3p7"),
    "mimo_v2_flash": lambda path: FIXTURES.write_mimo_v2_flash_checkpoint(path),
    "inkling": lambda path: FIXTURES.write_mtp_model_checkpoint(path, "inkling"),
}
TOKENS = np.array([5, 17, 3, 99, 200, 7, 42, 5])


def close(fast: np.ndarray, spec: np.ndarray) -> bool:
    """Equal within float32 rounding, relative to each row's largest entry."""
    scale = np.abs(spec).max(axis=1, keepdims=True) + 1e-30
    return bool((np.abs(fast - spec) <= 2e-6 * scale).all())


# ---- the function: means from prefix sums == softmax over zeros ------------------------------------------------

def sliding(t: int, window: int) -> torch.Tensor:
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    blocked = (j > i) | (j <= i - window)
    return torch.zeros(t, t).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


def qkv(t: int = 9, heads: int = 6, kv_heads: int = 2, d: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, t, d, generator=g), torch.randn(1, kv_heads, t, d, generator=g),
            torch.randn(1, kv_heads, t, d, generator=g) * 3 + 1)


@pytest.mark.parametrize("mask", [None, sliding(9, 9), sliding(9, 4), sliding(9, 1)], ids=["none", "causal",
                                                                                       "window4", "window1"])
@pytest.mark.parametrize("sink", [False, True])
def test_means_equal_the_specification(mask, sink):
    q, k, v = qkv()
    s_aux = torch.zeros(q.shape[1]) if sink else None
    fast, _ = uniform_mean_attention(None, q, k, v, mask, s_aux=s_aux)
    spec, _ = uniform_attention(None, q, k, v, mask, s_aux=s_aux)
    assert fast.shape == spec.shape == (1, 9, 6, 5)
    torch.testing.assert_close(fast, spec, rtol=2e-6, atol=2e-6)


def test_the_sink_takes_its_share_and_the_window_its_keys():
    """Twins: the sink's 1/(n+1) and the window's band both change the rows (a plain causal mean would not do)."""
    q, k, v = qkv()
    plain, _ = uniform_mean_attention(None, q, k, v, sliding(9, 9))
    with_sink, _ = uniform_mean_attention(None, q, k, v, sliding(9, 9), s_aux=torch.zeros(6))
    windowed, _ = uniform_mean_attention(None, q, k, v, sliding(9, 4))
    torch.testing.assert_close(with_sink[0, 2], plain[0, 2] * 3 / 4)  # 3 keys: 1/4 each instead of 1/3
    assert not torch.allclose(windowed[0, 8], plain[0, 8])
    torch.testing.assert_close(windowed[0, 3], plain[0, 3])  # within the window: the same keys


def test_masks_that_are_no_band_go_to_the_specification():
    """A mask with holes, or one holding a bias rather than visibility, is answered by the specification."""
    q, k, v = qkv()
    holes = sliding(9, 9).clone()
    holes[..., 6, 2] = torch.finfo(torch.float32).min
    bias = sliding(9, 9).clone()
    bias[..., 5, 1] = -0.5
    for mask in (holes, bias):
        fast, weights = uniform_mean_attention(None, q, k, v, mask)
        spec, _ = uniform_attention(None, q, k, v, mask)
        torch.testing.assert_close(fast, spec)
        assert weights is not None  # it came from the specification
    # and the band path would have been wrong there: the hole's key is in the plain causal mean
    plain, _ = uniform_mean_attention(None, q, k, v, sliding(9, 9))
    assert not torch.allclose(plain[0, 6], uniform_attention(None, q, k, v, holes)[0][0, 6])


# ---- every family: the export's pass == today's pass -----------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, WRITERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")


def head_and_inputs(ckpt: Path, tokens: np.ndarray):
    c = Checkpoint(ckpt)
    impl = head_module(c.family)
    head, rotary = impl.build_head(c.config, impl.torch_weights(c.read_head(widen=False, digest=False)))
    embed = impl.embedding_rows(c, tokens)[0] if hasattr(impl, "embedding_rows") else c.embedding_rows(tokens)
    hidden = hidden_from_seed(0, len(tokens), c.family.hidden_width(c.config))
    return impl, head, rotary, TraceInputs(token_ids=tokens, positions=positions_from_start(len(tokens), 0),
                                           hidden=hidden, embed=embed)


@pytest.mark.parametrize("t", [1, 8])
def test_every_family_gives_todays_evidence_with_projections_reused(family, t):
    name, ckpt = family
    impl, head, rotary, inputs = head_and_inputs(ckpt, TOKENS[:t])
    with reused_projections(head) as memo:
        stages = impl.run_batched(head, rotary, inputs)
        fast = impl.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])
    with specified_uniform_weights():
        spec = impl.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])
    assert fast.dtype == spec.dtype == np.float32 and fast.shape == spec.shape == stages["attn"].shape
    assert close(fast, spec), (name, np.abs(fast - spec).max())
    assert memo.hits >= 2, name  # at least the projections of q and of k/v (or their latents) came back


def test_a_different_input_is_projected_again(family):
    """Twin: the memo hands nothing back for rows it did not see (the uniform pass over other `ah` rows is today's
    on those rows, not the recorded projections)."""
    name, ckpt = family
    impl, head, rotary, inputs = head_and_inputs(ckpt, TOKENS)
    with reused_projections(head) as memo:
        stages = impl.run_batched(head, rotary, inputs)
        other = np.ascontiguousarray(stages["ah"][::-1])  # the same rows in reverse: other keys visible
        fast = impl.attention_with_uniform_weights(head, rotary, inputs, other)
    with specified_uniform_weights():
        spec = impl.attention_with_uniform_weights(head, rotary, inputs, other)
        stale = impl.attention_with_uniform_weights(head, rotary, inputs, stages["ah"])
    assert memo.hits == 0, name
    assert close(fast, spec) and not close(fast, stale), name


def test_every_familys_export_keeps_the_probes_evidence_decisions(family, tmp_path):
    name, ckpt = family
    traces = {}
    for path in ("fast", "spec"):
        traces[path] = tmp_path / f"{path}.h5"
        with specified_uniform_weights() if path == "spec" else _nothing():
            export_trace(ckpt, traces[path], TOKENS, HiddenSource(seed=0))
    with read_trace(traces["fast"]) as fast, read_trace(traces["spec"]) as spec:
        assert close(fast.evidence_rows("attn_uniform", 0, 8), spec.evidence_rows("attn_uniform", 0, 8)), name
        np.testing.assert_array_equal(fast.stage_rows("attn"), spec.stage_rows("attn"))
    np.testing.assert_array_equal(*map(decisions, traces.values()))


def test_the_bundled_reference_keeps_its_evidence_and_decisions(tmp_path):
    out = tmp_path / "regen.h5"
    export_trace(TINY, out, np.array([17, 42, 3, 255, 100, 7, 511, 64]), HiddenSource(seed=0))
    with read_trace(TINY_REF) as stored, read_trace(out) as fresh:
        assert close(fresh.evidence_rows("attn_uniform", 0, 8), stored.evidence_rows("attn_uniform", 0, 8))
    decided = decisions(out), decisions(TINY_REF)
    np.testing.assert_array_equal(*decided)
    assert decided[0][1:].any()  # the fixture's rows past t=0 do evidence q/k: a decision that could change


def decisions(path: Path) -> np.ndarray:
    """The probe's per-token decision: does this reference's attn row evidence q/k (default tolerance)."""
    with open_reference(path) as ref:
        return qk_sensitivity(ref, DEFAULT).sensitive


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
