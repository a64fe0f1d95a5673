"""LmHead.argmax against the exact argmax: integer arithmetic on the exact values, ties to the lowest id.

The reference below shares nothing with the implementation: every float32 / bf16 value is an integer multiple of
2^-149, so each logit is an exact Python integer (times 2^-298) and the argmax is exact. A float32 GEMM is no
reference (its rounding depends on its summation order, so it breaks exact ties and 1-ulp gaps either way).
"""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import lm_head as lm_head_module
from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError, InputError
from oracle.lm_head import lm_head_of
from tests.helpers import FIXTURES

TRAINED = FIXTURES / "qwen3_5_trained"


def exact_argmax(rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmax_v Σ_i x_i·w[v, i] in exact integer arithmetic (units of 2^-298); ties to the lowest id."""
    def units(a: np.ndarray) -> list[list[int]]:
        return [[int(v * 2.0**149) for v in row] for row in np.asarray(a, dtype=np.float64)]  # exact: float64

    w_units = units(w)
    best = []
    for x in units(rows):
        logits = [sum(a * b for a, b in zip(x, wv)) for wv in w_units]
        best.append(logits.index(max(logits)))  # index: the first, i.e. lowest, id of the maximum
    return np.array(best)


def checkpoint_with(tmp_path, w: torch.Tensor) -> Checkpoint:
    """A checkpoint of the trained fixture's config holding only lm_head.weight = w (any shape, as stored)."""
    config = json.loads((TRAINED / "config.json").read_text())
    config["text_config"].update(vocab_size=w.shape[0], hidden_size=w.shape[1])
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": w.contiguous()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return Checkpoint(tmp_path)


def stored(w: torch.Tensor) -> np.ndarray:
    return w.float().numpy()  # bf16/f16/f32 -> float32 is exact


@pytest.fixture(autouse=True, params=[True, False], ids=["bf16-screen", "f32-screen"])
def screen(request, monkeypatch) -> bool:
    """Every test runs with both screens of bf16 weights, whichever this CPU would pick (lm_head.BF16_SCREEN: the
    bf16 GEMM where oneDNN has AVX512-BF16/AMX kernels, the chunk widened and a float32 GEMM elsewhere)."""
    monkeypatch.setattr(lm_head_module, "BF16_SCREEN", request.param)
    return request.param


@pytest.fixture(scope="module")
def trained_w() -> torch.Tensor:
    return load_file(TRAINED / "model.safetensors")["lm_head.weight"]  # (96, 64) bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 40, 96, 1000])
def test_argmax_is_the_exact_argmax_for_any_chunking_and_stored_dtype(tmp_path, trained_w, dtype, chunk_rows):
    w = trained_w.to(dtype)
    rows = np.random.default_rng(chunk_rows).standard_normal((12, 64)).astype(np.float32)
    ids = lm_head_of(checkpoint_with(tmp_path, w), chunk_rows=chunk_rows).argmax(rows)
    np.testing.assert_array_equal(ids, exact_argmax(rows, stored(w)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_an_exact_tie_across_a_chunk_boundary_goes_to_the_lowest_id(tmp_path, trained_w, dtype):
    """w[3] == w[70], chunk boundary at 40: equal logits in every summation order; the lower id must win. (numpy's
    one-shot float32 matmul rounds the two rows differently and picks 70 for some of these rows.)"""
    w = trained_w.float()
    rows = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32)
    w[3] = w[70] = 4.0 * torch.from_numpy(np.sign(rows[:25].sum(axis=0)))  # the maximum for most of rows 0..24
    w = w.to(dtype)
    ids = lm_head_of(checkpoint_with(tmp_path, w), chunk_rows=40).argmax(rows)
    expected = exact_argmax(rows, stored(w))
    assert (expected[:25] == 3).sum() >= 20 and not (expected == 70).any()
    np.testing.assert_array_equal(ids, expected)


def test_logits_one_float32_ulp_apart_are_told_apart_whichever_id_is_lower(tmp_path, trained_w):
    """Rows a, b equal but for one weight that adds x_1 = 2^-23 to one of them: their logits (~2) differ by one
    float32 ulp, below a float32 GEMM's rounding. The exactly larger one wins, even at the higher id."""
    w = trained_w.float()
    rows = np.zeros((4, 64), dtype=np.float32)
    rows[:, 0] = 1.0
    rows[:, 1] = 2.0**-23
    rows[:, 2:] = np.random.default_rng(1).standard_normal((4, 62)).astype(np.float32) * 2.0**-12
    for a, b in ((10, 20), (50, 45)):  # (id that gets the extra 2^-23, its twin): higher, then lower id
        w[a] = w[b] = torch.from_numpy(np.where(np.arange(64) == 0, 2.0, 0.0)).float()
        w[a, 1] = 1.0
    w = w.bfloat16()
    ids = lm_head_of(checkpoint_with(tmp_path, w), chunk_rows=16).argmax(rows)
    expected = exact_argmax(rows, stored(w))
    assert set(expected) <= {10, 50}
    np.testing.assert_array_equal(ids, expected)


def test_many_survivors_one_bf16_ulp_apart_and_tied(tmp_path):
    """Every row of W equal to one base row, some nudged by a bf16 ulp in one place: all of them survive the screen
    and the rescoring must find the exactly largest, lowest id among equals."""
    rng = np.random.default_rng(2)
    base = torch.from_numpy(rng.standard_normal(256).astype(np.float32)).bfloat16()
    w = base.repeat(300, 1)  # (300, 256)
    bits = w.view(torch.int16)
    nudged = rng.choice(300, 40, replace=False)
    bits[nudged, rng.integers(0, 256, 40)] += torch.from_numpy(rng.choice([-1, 1], 40).astype(np.int16))
    rows = rng.standard_normal((8, 256)).astype(np.float32)
    rows[0] = stored(base)  # aligned with the base row: the nudges decide
    ids = lm_head_of(checkpoint_with(tmp_path, w), chunk_rows=64).argmax(rows)
    np.testing.assert_array_equal(ids, exact_argmax(rows, stored(w)))


def test_ties_and_gaps_that_float64_summation_gets_wrong_are_decided_exactly(tmp_path):
    """x = (1, 1, 1, 1, 0, ...). Id 5: (2^100, 1, -2^100, 0) and id 60: (2^100, -2^100, 1, 0) both sum to exactly
    1, but float64 loses the 1 next to 2^100 in one of them: the lower id must win. Id 90 adds 2^-20 to id 5's row,
    the exact maximum although float64 may sum it to 0."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.standard_normal((96, 64)).astype(np.float32) * 0.01)
    w[:, :4] = 0.0
    w[5, :4] = torch.tensor([2.0**100, 1.0, -(2.0**100), 0.0])
    w[60, :4] = torch.tensor([2.0**100, -(2.0**100), 1.0, 0.0])
    rows = np.zeros((2, 64), dtype=np.float32)
    rows[:, :4] = 1.0
    rows[1, 10] = 2.0**-40  # a second row, nearly the same
    head = lm_head_of(checkpoint_with(tmp_path / "tie", w.bfloat16()), chunk_rows=50)
    np.testing.assert_array_equal(head.argmax(rows), [5, 5])
    w[90, :4] = torch.tensor([2.0**100, 1.0, -(2.0**100), 2.0**-20])
    head = lm_head_of(checkpoint_with(tmp_path / "gap", w.bfloat16()), chunk_rows=50)
    np.testing.assert_array_equal(head.argmax(rows), [90, 90])


def test_degenerate_rows_zero_negative_huge_and_tiny(tmp_path, trained_w):
    """x = 0 (every logit 0: id 0), all logits negative, and rows scaled by 2^60 and 2^-120 (subnormal products)."""
    w = trained_w
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, 64)).astype(np.float32)
    rows[0] = 0.0
    rows[1] = np.abs(rows[1])
    rows[2] *= 2.0**60
    rows[3] *= 2.0**-120
    negative = -torch.abs(w)  # with rows[1] >= 0 every logit is negative
    for weights in (w, negative):
        ids = lm_head_of(checkpoint_with(tmp_path, weights), chunk_rows=30).argmax(rows)
        np.testing.assert_array_equal(ids, exact_argmax(rows, stored(weights)))
    assert ids[0] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_screen_bound_holds_for_every_logit_at_real_width(tmp_path, dtype):
    """The measured side of the bound's one assumption (the GEMM accumulates in float32): at D=5120, for every
    (row, id), |exact logit - screen score| <= A + rel·|score|. Rows with a wide dynamic range included. The bf16
    screen forced on a CPU without oneDNN's bf16 kernels measures torch's generic bf16 loop against the same bound."""
    rng = np.random.default_rng(4)
    w = torch.from_numpy(rng.standard_normal((2048, 5120)).astype(np.float32) * 0.02).to(dtype)
    rows = rng.standard_normal((16, 5120)).astype(np.float32)
    rows[:4] *= np.exp2(rng.integers(-30, 30, (4, 5120))).astype(np.float32)
    head = lm_head_of(checkpoint_with(tmp_path, w), chunk_rows=2048)
    operand, weight, phi, rel = lm_head_module._screen_operand(rows, head._bf16_screen())
    start, chunk = next(head._chunks())
    colmax = head._colmax(start, chunk)
    slack = weight.numpy() @ colmax.astype(np.float64) + phi + lm_head_module.FLUSH * colmax.sum()
    score = (operand @ chunk.T).double().numpy()
    exact = rows.astype(np.float64) @ stored(w).astype(np.float64).T  # within ~1e-12 of the exact logits
    used = np.abs(exact - score) / (slack[:, None] + rel * np.abs(score))
    assert used.max() < 0.5, used.max()  # a kernel rounding partial sums to bf16 would use > 1


def _exact_weight_floor(rows: np.ndarray, kept: np.ndarray) -> list:
    """|x - kept| + gamma·|kept| per element in exact rational arithmetic (what the screen's weight must cover)."""
    d = rows.shape[1]
    gamma = Fraction(d) * Fraction(lm_head_module.U32) / (1 - Fraction(d) * Fraction(lm_head_module.U32))
    return [abs(Fraction(float(x)) - Fraction(float(k))) + gamma * abs(Fraction(float(k)))
            for x, k in zip(rows.ravel(), kept.ravel())]


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_the_screen_weight_covers_gamma_times_each_entry_exactly(bf16):
    # the weight of M in A (module docstring, 2) is an upper bound on |x - kept| + gamma·|kept|, element by element,
    # as real numbers: computed in float64 and rounded up, never a float32 product that could round below it
    rows = np.random.default_rng(11).standard_normal((4, 96)).astype(np.float32)
    operand, weight, phi, rel = lm_head_module._screen_operand(rows, bf16)
    kept = operand.float().numpy()
    got = weight.numpy().ravel()
    assert all(Fraction(float(w)) >= need for w, need in zip(got, _exact_weight_floor(rows, kept)))


def test_twin_a_float32_gamma_product_falls_below_the_exact_weight():
    # the form the screen had before: gamma·|kept| taken in float32 (numpy keeps a float32 array's dtype for a
    # Python float factor) rounds below the real product for some entries, which (1 + 2^-30) does not cover
    rows = np.random.default_rng(11).standard_normal((4, 96)).astype(np.float32)
    d = rows.shape[1]
    gamma = d * lm_head_module.U32 / (1 - d * lm_head_module.U32)
    old = ((np.abs(rows - rows).astype(np.float64) + gamma * np.abs(rows)) * (1 + 2.0**-30)).ravel()
    assert (gamma * np.abs(rows)).dtype == np.float32
    assert any(Fraction(float(w)) < need for w, need in zip(old, _exact_weight_floor(rows, rows)))


def test_a_screen_that_breaks_its_bound_is_caught_not_trusted(tmp_path, trained_w, monkeypatch):
    """Twin: scores 1% off (as a kernel that does not accumulate as assumed might give) raise, never answer."""
    real = lm_head_module._screen_operand

    def off(x, bf16):
        operand, weight, phi, rel = real(x, bf16)
        return operand * 1.01, weight, phi, rel

    monkeypatch.setattr(lm_head_module, "_screen_operand", off)
    rows = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    with pytest.raises(RuntimeError, match="error bound failed"):
        lm_head_of(checkpoint_with(tmp_path, trained_w), chunk_rows=40).argmax(rows)


def test_the_screen_keeps_few_candidates_on_the_trained_fixture(tmp_path, trained_w, monkeypatch):
    """The bound is useful, not only safe: on trained-head-like rows most ids are pruned without rescoring."""
    kept = []
    screen = lm_head_module.LmHead._screen
    monkeypatch.setattr(lm_head_module.LmHead, "_screen", lambda self, x: kept.append(screen(self, x)) or kept[-1])
    rows = stored(trained_w)[np.random.default_rng(6).integers(0, 96, 30)] * 8.0  # peaked logits
    ids = lm_head_of(checkpoint_with(tmp_path, trained_w)).argmax(rows)
    np.testing.assert_array_equal(ids, exact_argmax(rows, stored(trained_w)))
    assert len(kept[0].ids) <= 3 * len(rows)


def test_rows_with_nan_or_inf_are_refused(tmp_path, trained_w):
    rows = np.zeros((3, 64), dtype=np.float32)
    rows[1, 5] = np.nan
    with pytest.raises(InputError, match="NaN or Inf"):
        lm_head_of(checkpoint_with(tmp_path, trained_w)).argmax(rows)
    assert lm_head_of(checkpoint_with(tmp_path, trained_w)).argmax(rows[:0]).shape == (0,)


@pytest.mark.parametrize("block", [1, 3, 64, 1000])
def test_the_column_maximum_is_max_abs_of_the_stored_bf16(block):
    """The screen's bound rests on M[c, i] >= |w[v, i]|: the blocked bit-pattern maximum must equal max |w| exactly,
    with negative columns, -0, subnormals and a tail block shorter than the others."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(131, 40, generator=g) * torch.logspace(-40, 3, 40)).bfloat16()
    w[:, 0] = -w[:, 0].abs()  # an all-negative column: its maximum is a negative pattern's magnitude
    w[:, 1] = -0.0
    w[5, 2] = torch.tensor(-1e-39).bfloat16()  # subnormal, the column's only nonzero
    w[np.arange(131) != 5, 2] = 0.0
    got, norm_sq = lm_head_module._bf16_column_max(w.view(torch.int16).numpy(), block=block)
    np.testing.assert_array_equal(got, w.abs().amax(dim=0).float().numpy())
    assert got[0] > 0 and got[1] == 0 and got[2] > 0
    exact = (w.double() ** 2).sum(dim=1).max().item()  # the same pass's squared row norms: float32 sums
    assert abs(float(norm_sq) - exact) <= 40 * 2.0**-24 * exact


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_nan_or_inf_weight_is_refused_not_screened(tmp_path, trained_w, bad):
    """Twin of the test above: a column maximum that is not finite would make every bound meaningless."""
    w = trained_w.clone()
    w[7, 3] = bad
    rows = np.ones((2, w.shape[1]), dtype=np.float32)
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        lm_head_of(checkpoint_with(tmp_path, w)).argmax(rows)


# --- row_norm_max, folded into the screen's sweep ----------------------------------------------------------------


def counted_reads(monkeypatch) -> list:
    """Every (start, stop) of lm_head rows read from the checkpoint from now on."""
    from oracle.checkpoint import Checkpoint

    reads, stored_rows = [], Checkpoint.stored_rows
    monkeypatch.setattr(Checkpoint, "stored_rows", lambda self, name, start, stop, into=None:
                        reads.append((start, stop)) or stored_rows(self, name, start, stop, into=into))
    return reads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("chunk_rows", [7, 40, 8192])
def test_the_folded_sweep_gives_the_same_row_norm_max_and_drafts_as_separate_passes(tmp_path, trained_w, dtype,
                                                                                    chunk_rows, monkeypatch):
    """row_norm_max is taken in the screen's column-maximum pass: after a screen it reads no row again, and it equals
    the value of its own pass over the rows (row_norm_max before any screen), with the same drafts and margins
    either way; both are the documented upper bound on the largest exact row norm."""
    w = trained_w.to(dtype).clone()  # the fixture is shared: never edit it in place
    w[17] = w[17] * 4  # one row clearly the largest
    rows = np.random.default_rng(5).standard_normal((9, 64)).astype(np.float32)
    separate = lm_head_of(checkpoint_with(tmp_path / "separate", w), chunk_rows=chunk_rows)
    norm_first = separate.row_norm_max()  # its own pass: no screen ran
    ids_after, margin_after = separate.argmax_margin(rows)
    folded = lm_head_of(checkpoint_with(tmp_path / "folded", w), chunk_rows=chunk_rows)
    ids, margin = folded.argmax_margin(rows)
    reads = counted_reads(monkeypatch)
    norm_folded = folded.row_norm_max()
    assert norm_folded == norm_first and not reads  # the same value, nothing read a second time
    np.testing.assert_array_equal(ids, ids_after)
    np.testing.assert_array_equal(margin, margin_after)
    np.testing.assert_array_equal(ids, exact_argmax(rows, stored(w)))
    exact = np.linalg.norm(stored(w).astype(np.float64), axis=1).max()
    assert exact <= norm_folded <= exact * (1 + 2**-9)
    old = float(torch.linalg.vector_norm(w, dim=1, dtype=torch.float32).max()) * (1 + 2.0**-10)  # before the fold
    assert abs(norm_folded - old) <= 64 * 2.0**-24 * exact  # within the float32 rounding the bound allows for


def test_twin_row_norm_max_follows_the_largest_row_not_a_stale_chunk(tmp_path, trained_w):
    """Twin: the folded value is measured per chunk; a larger row in the last chunk raises it, a screen of another
    head leaves it alone."""
    base = lm_head_of(checkpoint_with(tmp_path / "base", trained_w), chunk_rows=40)
    base.argmax(np.ones((1, 64), dtype=np.float32))
    w = trained_w.clone()
    w[95] = w[95] * 8  # the last (short) chunk
    grown = lm_head_of(checkpoint_with(tmp_path / "grown", w), chunk_rows=40)
    grown.argmax(np.ones((1, 64), dtype=np.float32))
    assert grown.row_norm_max() > base.row_norm_max()
    exact = np.linalg.norm(stored(w).astype(np.float64), axis=1).max()
    assert exact <= grown.row_norm_max() <= exact * (1 + 2**-9)


def test_read_ahead_advises_exactly_the_projection_bytes_and_a_failure_is_only_a_hint(tmp_path, trained_w,
                                                                                     monkeypatch):
    """The export asks for the lm_head's pages before its forward: the advice covers the tensor's stored bytes (not
    the shard, not another tensor), and an OS that refuses it leaves the argmax as it was."""
    import threading

    head = lm_head_of(checkpoint_with(tmp_path, trained_w), chunk_rows=40)
    entry = head.checkpoint.entry(head.name)
    advised, done = [], threading.Event()

    def advise(fd, offset, length, advice):
        advised.append((offset, length, advice))
        done.set()
        raise OSError("not supported here")

    monkeypatch.setattr(lm_head_module.os, "posix_fadvise", advise)
    head.read_ahead()
    assert done.wait(10)
    assert advised == [(entry.offset, entry.nbytes, lm_head_module.os.POSIX_FADV_WILLNEED)]
    assert entry.nbytes == trained_w.numel() * 2
    rows = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(head.argmax(rows), exact_argmax(rows, stored(trained_w)))


def test_the_screen_runs_the_gemm_it_says_on_bf16_weights(tmp_path, trained_w, screen):
    """BF16_SCREEN picks the GEMM: bf16 chunks as stored for the bf16 screen, widened exactly to float32 otherwise
    (a CPU without oneDNN's bf16 kernels: torch's generic bf16 loop ran at 1/5 of the float32 GEMM there)."""
    head = lm_head_of(checkpoint_with(tmp_path, trained_w), chunk_rows=40)
    dtypes = {w.dtype for _, w in head._chunks()}
    assert dtypes == {torch.bfloat16 if screen else torch.float32}
    assert head._bf16_screen() is screen
    rows = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    assert lm_head_module._screen_operand(rows, screen)[0].dtype == (torch.bfloat16 if screen else torch.float32)
