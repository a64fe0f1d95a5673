"""The projection archive (oracle/attention_evidence.py ProjectionArchive): an export with --chain hands the q/k-part
variant passes of its stacked chain rows the rows the real passes projected, and computes only the rest.

What must hold: a row is taken only where its input bits equal an archived row's under the very weight that
projected it; the taken rows are the real pass's own bits; every other row is computed; nothing that is not a
row-wise linear, nor a skipped one, is archived. Each claim has its twin: a flipped bit, a swapped weight, a grouped
linear, and the export without the archive (which projects the stacked rows again)."""

import contextlib

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import oracle.attention_evidence as attention_evidence
from oracle.attention_evidence import ProjectionArchive, archived_projections
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.torch_parts import UpcastLinear
from tests.helpers import TINY
from tests.probe.test_qk_parts import TOKENS


def _linear(seed: int, rows: int = 6, cols: int = 4) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(cols, rows, bias=False)


class Forward:
    """The rows a linear really computes (what assemble hands to forward)."""

    def __init__(self, linear):
        self.linear, self.rows = linear, 0

    def __call__(self, x):
        self.rows += x.reshape(-1, x.shape[-1]).shape[0]
        return self.linear(x)


def _recorded(linear, x):
    archive = ProjectionArchive()
    with torch.inference_mode():
        archive.record(linear, x, linear(x))
    return archive


def test_archived_rows_are_the_real_passs_bits_and_only_the_others_are_computed():
    linear = _linear(0)
    real = torch.randn(1, 5, 4)
    archive = _recorded(linear, real)
    new = torch.randn(1, 2, 4)
    stacked = torch.cat([real[:, 3:], new, real[:, :2]], dim=1)  # archived rows, in another order, around new ones
    forward = Forward(linear)
    with torch.inference_mode():
        got = archive.assemble(linear, stacked, forward)
        expected = torch.cat([linear(real)[:, 3:], linear(new), linear(real)[:, :2]], dim=1)
    assert forward.rows == 2  # the two new rows alone
    assert got.shape == expected.shape == (1, 6, 6)
    assert torch.equal(got[:, :2], linear(real)[:, 3:]) and torch.equal(got[:, 4:], linear(real)[:, :2])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_twin_a_row_one_bit_away_from_an_archived_one_is_computed():
    linear = _linear(1)
    real = torch.randn(1, 3, 4)
    archive = _recorded(linear, real)
    near = real.clone()
    bits = near[0, 1].view(torch.int32)
    bits[2] ^= 1  # the last bit of one element: another input row
    forward = Forward(linear)
    with torch.inference_mode():
        got = archive.assemble(linear, near, forward)
        assert forward.rows == 1  # computed alone: its bits may differ from a 3-row matmul's in the last place
        torch.testing.assert_close(got[0, 1], linear(near)[0, 1], rtol=0, atol=1e-6)
        assert not torch.equal(got[0, 1], linear(real)[0, 1])
        assert torch.equal(got[0, [0, 2]], linear(real)[0, [0, 2]])


def test_twin_a_swapped_weight_computes_every_row():
    linear = _linear(2)
    real = torch.randn(1, 3, 4)
    archive = _recorded(linear, real)
    linear.weight = nn.Parameter(torch.zeros_like(linear.weight), requires_grad=False)  # a variant's swap
    forward = Forward(linear)
    with torch.inference_mode():
        got = archive.assemble(linear, real, forward)
    assert forward.rows == 3 and torch.equal(got, torch.zeros(1, 3, 6))


def test_twin_skipped_and_grouped_linears_are_never_archived():
    plain, skipped = _linear(3), _linear(4)

    class Grouped(nn.Module):  # a weight block per group: a row's output depends on where it sits
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 4), requires_grad=False)

        def forward(self, x):
            return x @ self.weight.T * torch.arange(1, x.shape[-2] + 1)[:, None]

    grouped = Grouped()
    x = torch.randn(1, 3, 4)
    archive = ProjectionArchive(skip=[skipped])
    with torch.inference_mode():
        for linear in (plain, skipped, grouped):
            archive.record(linear, x, linear(x))
    assert set(archive.entries) == {plain}
    forward = Forward(grouped)
    with torch.inference_mode():
        archive.assemble(grouped, x.flip(1), forward)
    assert forward.rows == 3


def test_an_upcast_linear_is_archived_as_a_plain_one():
    weight = torch.randn(6, 4).to(torch.bfloat16)
    linear = UpcastLinear(weight)
    x = torch.randn(1, 3, 4)
    archive = _recorded(linear, x)
    forward = Forward(linear)
    with torch.inference_mode():
        got = archive.assemble(linear, x[:, [2, 0]], forward)
    assert forward.rows == 0 and torch.equal(got, linear(x)[:, [2, 0]])


def _counted_export(tmp_path, monkeypatch, archive: bool):
    """export --chain 3 on the tiny Qwen head: q_proj rows computed in the chain q/k-part passes (after the real
    passes), and the trace."""
    from oracle import qk_parts
    from oracle.checkpoint import Checkpoint
    from oracle.families.registry import head_module

    impl = head_module(Checkpoint(TINY).family)
    counts = {"stacked_rows": 0, "in_stack": False}
    records = qk_parts.chain_part_records

    def counting_records(*args, **kwargs):
        counts["in_stack"] = True
        try:
            return records(*args, **kwargs)
        finally:
            counts["in_stack"] = False

    monkeypatch.setattr(qk_parts, "chain_part_records", counting_records)
    build = impl.build_head

    def counted_build(*args, **kwargs):
        head, rotary = build(*args, **kwargs)
        q_proj = head.layers[0].self_attn.q_proj
        original = type(q_proj).forward

        def counting(module, x):
            if module is q_proj and counts["in_stack"]:
                counts["stacked_rows"] += x.reshape(-1, x.shape[-1]).shape[0]
            return original(module, x)
        monkeypatch.setattr(type(q_proj), "forward", counting)
        return head, rotary

    monkeypatch.setattr(impl, "build_head", counted_build)
    if not archive:
        monkeypatch.setattr(attention_evidence, "archived_projections", lambda skip=(): contextlib.nullcontext())
    out = export_trace(TINY, tmp_path / f"ref_{archive}.h5", TOKENS, HiddenSource(seed=0), chain=ChainOptions(3))
    return counts["stacked_rows"], out


def test_a_chained_export_projects_none_of_its_stacked_rows_again(tmp_path, monkeypatch):
    rows, with_archive = _counted_export(tmp_path, monkeypatch, archive=True)
    assert rows == 0  # every bridge and chain row came back from the real passes
    assert attention_evidence._UNIFORM.archive is None  # and the archive ended with the export
    monkeypatch.undo()
    again, without = _counted_export(tmp_path, monkeypatch, archive=False)
    from oracle.draft_loop import chain_rows

    n2, n3 = chain_rows(len(TOKENS), 2), chain_rows(len(TOKENS), 3)
    stacked = n2 + n2 + n3  # the bridge rows the chains see (0..n_2-1), then every chain row
    assert again == stacked  # twin: without the archive the stacked pass projects every row once
    with h5py.File(with_archive) as a, h5py.File(without) as b:
        for j in (2, 3):
            names = [n for n in a[f"chain/d{j}/evidence"] if n.startswith("qk_")]
            assert names
            for name in names:
                np.testing.assert_allclose(a[f"chain/d{j}/evidence/{name}"][:], b[f"chain/d{j}/evidence/{name}"][:],
                                           rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_failing_export_leaves_no_archive_behind(tmp_path, monkeypatch):
    from oracle import export

    def failing(*args, **kwargs):
        raise RuntimeError("a chain failed")

    monkeypatch.setattr(export, "_chain_records", failing)
    with pytest.raises(RuntimeError, match="a chain failed"):
        export_trace(TINY, tmp_path / "ref.h5", TOKENS, HiddenSource(seed=0), chain=ChainOptions(3))
    assert attention_evidence._UNIFORM.archive is None
    with archived_projections() as archive:  # twin: inside the block the archive is installed
        assert attention_evidence._UNIFORM.archive is archive
