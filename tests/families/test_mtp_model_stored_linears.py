"""MtpModel heads keep their plain linears' bf16 weights behind UpcastLinear (oracle/families/mtp_model.py,
`_linears_load_as_stored`): the trace is bit-identical to the one the float32-widened load gives, and a checkpoint
whose matrices a cast to bf16 would change still loads widened, each value as stored."""

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import oracle.families.mtp_model as mtp_model
from oracle.checkpoint import Checkpoint
from oracle.export import ChainOptions, HiddenSource, export_trace
from oracle.families.registry import head_module
from oracle.families.torch_parts import UpcastLinear
from tests.helpers import FIXTURES

MTP_MODEL_FIXTURES = ["step3p7_tiny", "mimo_v2_flash_tiny", "inkling_tiny"]


def built(ckpt: Path, weights: dict | None = None):
    c = Checkpoint(ckpt)
    impl = head_module(c.family)
    stored = impl.torch_weights(c.read_head(widen=False, digest=False))
    return impl.build_head(c.config, {**stored, **(weights or {})})[0], stored


def datasets(path: Path) -> dict[str, np.ndarray]:
    found = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found


@pytest.mark.parametrize("fixture", MTP_MODEL_FIXTURES)
def test_the_plain_linears_stay_bf16_and_the_chained_trace_is_bit_identical_to_the_widened_load(
        fixture, tmp_path, monkeypatch):
    ckpt = FIXTURES / fixture
    head, _ = built(ckpt)
    upcast = [m for m in head.modules() if isinstance(m, UpcastLinear)]
    assert upcast and all(m.weight.dtype == torch.bfloat16 for m in upcast)
    assert not [m for m in head.modules() if type(m) is nn.Linear and m.weight.dtype != torch.float32 and
                not m.weight.is_meta]
    c = Checkpoint(ckpt)
    ids = ((np.arange(9) * 7 + 3) % c.config.vocab_size).astype(np.int64)
    export_trace(ckpt, tmp_path / "stored.h5", ids, HiddenSource(seed=0), chain=ChainOptions(3))
    monkeypatch.setattr(mtp_model, "_linears_load_as_stored", lambda state, conversions: False)
    export_trace(ckpt, tmp_path / "widened.h5", ids, HiddenSource(seed=0), chain=ChainOptions(3))
    stored, widened = datasets(tmp_path / "stored.h5"), datasets(tmp_path / "widened.h5")
    assert stored.keys() == widened.keys() and any(k.startswith("chain/d3/") for k in stored)
    assert [k for k in stored if not np.array_equal(stored[k], widened[k], equal_nan=True)] == []


def a_float32_matrix_bf16_cannot_hold(stored: dict) -> tuple[str, torch.Tensor]:
    name = next(n for n in sorted(stored) if n.endswith("eh_proj.weight"))
    wide = torch.randn(stored[name].shape, generator=torch.Generator().manual_seed(0)) * 0.05
    assert not torch.equal(wide.bfloat16().float(), wide)
    return name, wide


def eh_proj(head, name: str) -> nn.Module:
    layer = next(i for i in range(head.num_layers) if name.startswith(head.cfg.layer_prefix(i)))
    return head.mtp.layers[layer].eh_proj


def test_a_float32_matrix_bf16_cannot_hold_loads_widened_as_stored():
    _, stored = built(FIXTURES / "step3p7_tiny")
    name, wide = a_float32_matrix_bf16_cannot_hold(stored)
    head, _ = built(FIXTURES / "step3p7_tiny", {name: wide})
    assert not any(isinstance(m, UpcastLinear) for m in head.modules())
    assert torch.equal(eh_proj(head, name).weight, wide)


def test_twin_without_the_guard_the_same_matrix_would_be_rounded_to_bf16(monkeypatch):
    """What the guard prevents: loading that matrix into a bf16 linear rounds it."""
    _, stored = built(FIXTURES / "step3p7_tiny")
    name, wide = a_float32_matrix_bf16_cannot_hold(stored)
    monkeypatch.setattr(mtp_model, "_linears_load_as_stored", lambda state, conversions: True)
    head, _ = built(FIXTURES / "step3p7_tiny", {name: wide})
    assert not torch.equal(eh_proj(head, name).weight.float(), wide)


def test_a_conversion_that_computes_rather_than_moves_keeps_the_widened_load():
    class Scale:  # a conversion op outside MOVES_ONLY (e.g. a dequantization)
        pass

    class Conversion:
        operations = [Scale()]

    state = {"w": torch.ones(4, 4, dtype=torch.bfloat16)}
    assert mtp_model._linears_load_as_stored(state, [])
    assert not mtp_model._linears_load_as_stored(state, [Conversion()])
