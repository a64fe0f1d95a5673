"""qk_parts.measure with a family's baseline pass: a variant row whose output-projection input equals the
baseline's is the real row (distance 0, not projected again); every other row is projected and measured."""

import numpy as np
import torch
from torch import nn

from oracle import qk_parts
from oracle.qk_parts import PartVariant, baseline, measure


def setup(rows: int = 6, width: int = 8):
    torch.manual_seed(0)
    out = nn.Linear(width, 5, bias=False)
    x = torch.randn(1, rows, width)
    with torch.no_grad():
        real = out(x)[0].numpy()
    return out, x, real


def variant(out, x, name, change=None):
    def run():
        y = x.clone()
        if change is not None:
            change(y)
        return out(y)[0]
    return PartVariant("rope", name, run)


def counted(out):
    seen = []
    forward = type(out).forward

    def spy(self, x):
        seen.append(x.shape[0] if x.dim() == 2 else x.shape[-2])
        return forward(self, x)

    return seen, spy


def test_unchanged_rows_are_zero_and_not_projected_and_changed_ones_are(monkeypatch):
    out, x, real = setup()
    seen, spy = counted(out)
    monkeypatch.setattr(nn.Linear, "forward", spy)

    def second_row(y):
        y[0, 1] += 1.0

    records, names = measure([baseline(variant(out, x, "none").run), variant(out, x, "same"),
                              variant(out, x, "one_row", second_row)], real, out)
    d = records["qk_rope"]
    assert names == {"rope": ["same", "one_row"]}  # the baseline is never a recorded variant
    assert (d[:, 0] == 0).all()
    assert d[1, 1] > 0 and (np.delete(d[:, 1], 1) == 0).all()
    assert seen == [1]  # one matmul, of the one changed row


def test_twin_without_a_baseline_every_row_is_projected(monkeypatch):
    out, x, real = setup()
    seen, spy = counted(out)
    monkeypatch.setattr(nn.Linear, "forward", spy)
    records, _ = measure([variant(out, x, "same"), variant(out, x, "other", lambda y: y.mul_(2.0))], real, out)
    assert seen == [12]
    assert (records["qk_rope"][:, 1] > 0).all()


def test_a_nan_row_counts_as_changed_and_can_never_pass():
    out, x, real = setup()

    def nan_row(y):
        y[0, 3, 0] = float("nan")

    records, _ = measure([baseline(variant(out, x, "none").run), variant(out, x, "nan", nan_row)], real, out)
    d = records["qk_rope"][:, 0]
    assert d[3] == np.finfo(np.float32).max and (np.delete(d, 3) == 0).all()


def wide_setup(rows: int = 6, width: int = 8, columns: int = 12):
    torch.manual_seed(1)
    out = nn.Linear(width, columns, bias=False)
    x = torch.randn(1, rows, width)
    with torch.no_grad():
        real = out(x)[0].numpy()
    return out, x, real


def test_a_wide_output_projection_is_measured_over_every_kth_column_a_lower_bound(monkeypatch):
    """Past MEASURED_COLUMNS the distance is the max over every k-th output column: never above the full max (a
    row is never taken for evidence it is not), equal to the max over exactly those columns."""
    out, x, real = wide_setup()

    def scaled(y):
        y[0, 2:] *= 1.5

    variants = [baseline(variant(out, x, "none").run), variant(out, x, "scaled", scaled)]
    full, _ = measure(variants, real, out)
    monkeypatch.setattr(qk_parts, "MEASURED_COLUMNS", 4)
    assert list(qk_parts.measured_columns(out)) == [0, 3, 6, 9]
    part, _ = measure(variants, real, out)
    with torch.no_grad():
        y = x.clone()
        scaled(y)
        moved = np.abs(out(y)[0].numpy().astype(np.float64) - real)
    np.testing.assert_allclose(part["qk_rope"][:, 0], moved[:, [0, 3, 6, 9]].max(axis=1), rtol=1e-6)
    assert (part["qk_rope"] <= full["qk_rope"]).all() and (part["qk_rope"][:2] == 0).all()
    assert (part["qk_rope"][2:] < full["qk_rope"][2:]).any()  # the price: a bound, not the max


def test_twin_a_narrow_or_unusual_projection_is_measured_over_every_column(monkeypatch):
    monkeypatch.setattr(qk_parts, "MEASURED_COLUMNS", 4)
    out, _, _ = wide_setup(columns=4)
    assert qk_parts.measured_columns(out) is None  # no wider than the limit
    biased = nn.Linear(8, 12, bias=True)
    assert qk_parts.measured_columns(biased) is None  # a bias: the weight's rows alone are not its output


def test_a_bf16_upcast_projection_measures_its_columns_widened_exactly(monkeypatch):
    from oracle.families.torch_parts import UpcastLinear

    monkeypatch.setattr(qk_parts, "MEASURED_COLUMNS", 4)
    w = torch.randn(12, 8).bfloat16()
    x = torch.randn(5, 8)
    got = qk_parts._project(UpcastLinear(w), x, np.array([0, 3, 6, 9]))
    np.testing.assert_array_equal(got.numpy(), torch.nn.functional.linear(x, w.float()[[0, 3, 6, 9]]).numpy())


def test_qwen_variant_passes_run_sdpa_only_under_an_explicit_mask_and_restore_eager():
    from types import SimpleNamespace

    from oracle.qk_parts import fused_attention

    attention = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"))
    with fused_attention(attention, torch.zeros(1, 1, 2, 2)):
        assert attention.config._attn_implementation == "sdpa"
    assert attention.config._attn_implementation == "eager"
    with fused_attention(attention, None):  # twin: without a mask SDPA would be causal where eager is not
        assert attention.config._attn_implementation == "eager"
    try:
        with fused_attention(attention, torch.zeros(1, 1, 2, 2)):
            raise KeyError("a failing variant")
    except KeyError:
        pass
    assert attention.config._attn_implementation == "eager"


def test_measured_columns_are_projected_at_each_call_and_no_variant_input_is_kept(monkeypatch):
    """Past MEASURED_COLUMNS, after the baseline, each variant call keeps its changed rows' measured columns only
    (the chained 27B export's peak RSS held nine whole o_proj inputs); twin: without a baseline the calls keep their
    inputs for one matmul in finish, as before. Both give the distances over the same columns."""
    out, x, real = wide_setup()
    monkeypatch.setattr(qk_parts, "MEASURED_COLUMNS", 4)
    kept = []
    finish = qk_parts._Deferred.finish

    def spying(self, r):
        kept.append(list(self.inputs))
        return finish(self, r)

    monkeypatch.setattr(qk_parts._Deferred, "finish", spying)

    def scaled(y):
        y[0, 2:] *= 1.5

    with_base, _ = measure([baseline(variant(out, x, "none").run), variant(out, x, "scaled", scaled)], real, out)
    without, _ = measure([variant(out, x, "scaled", scaled)], real, out)
    projected, deferred = kept
    assert [type(i).__name__ for i in projected] == ["_Projected"]
    assert projected[0].rows.shape == (4, 4)  # rows 2..5 changed, 4 measured columns
    assert isinstance(deferred[0], torch.Tensor) and deferred[0].shape == (1, 6, 8)
    np.testing.assert_allclose(with_base["qk_rope"][2:], without["qk_rope"][2:], rtol=1e-6, atol=0)
    assert (with_base["qk_rope"][:2] == 0).all()  # the unchanged rows: the real rows (recomputed without a baseline)
