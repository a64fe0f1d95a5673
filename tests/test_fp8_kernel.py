"""The compiled FP8 block dequant (oracle/_fp8dequant.c) against its specification, oracle.fp8.dequantize_numpy,
and both against a straightforward torch dequant."""

import numpy as np
import pytest
import torch

from oracle import fp8
from oracle.checkpoint import E8M0, _widen
from oracle.fp8 import dequantize, dequantize_numpy, scale_shape

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the 3e38 scales

NAN_BYTES, NEG_ZERO, SUBNORMALS = (0x7F, 0xFF), 0x80, [*range(0x01, 0x08), *range(0x81, 0x88)]


def every_byte(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """e4m3 bytes with all 256 patterns in the first 256 elements (in row-major order), random after."""
    bits = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    flat = bits.reshape(-1)
    flat[:256] = np.arange(256, dtype=np.uint8)[: flat.size]
    return bits


def f32_scales(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """weight_scale_inv as released (positive float32), with the edge cases a scale can be: tiny (products go
    subnormal), huge (products overflow to inf), negative, zero, NaN."""
    scales = np.random.default_rng(seed).uniform(1e-4, 1.0, size=shape).astype(np.float32)
    flat = scales.reshape(-1)
    edge = np.array([2.0**-140, 3.0e38, -0.75, 0.0, np.nan], dtype=np.float32)
    flat[1: 1 + len(edge)] = edge[: max(0, flat.size - 1)]
    return scales


def ue8m0_scales(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """DeepSeek-V4 `.scale` UE8M0 exponents, decoded to float32 as the checkpoint reader hands them to dequantize
    (2^(bits - 127); 255 is NaN; 0 is the subnormal 2^-127)."""
    raw = np.random.default_rng(seed).integers(100, 140, size=shape, dtype=np.uint8)
    raw.reshape(-1)[1:4] = [0, 254, 255][: max(0, raw.size - 1)]
    return _widen(raw, E8M0)


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def spec(bits: np.ndarray, scales: np.ndarray, block) -> np.ndarray:
    return dequantize_numpy(bits, scales, block, np.empty(bits.shape, dtype=np.float32))


def torch_dequant(bits: np.ndarray, scales: np.ndarray, block) -> np.ndarray:
    """The straightforward dequant: e4m3 -> float32 in torch, times the block grid expanded to the weight's shape."""
    w = torch.from_numpy(bits).view(torch.float8_e4m3fn).float()
    grid = torch.from_numpy(scales).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (w * grid[: w.shape[0], : w.shape[1]]).numpy()


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal except NaN payloads (torch decodes e4m3 NaN to 0x7ff00000/0xfff00000, the table to 0x7fc00000)."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return np.array_equal(nan_a, nan_b) and np.array_equal(bits_of(a)[~nan_a], bits_of(b)[~nan_b])


CASES = [((130, 257), (128, 128)), ((1, 1), (128, 128)), ((256, 512), (128, 128)), ((37, 70), (16, 32)),
         ((300, 200), (128, 128)), ((16, 256), (1, 1)), ((5, 3), (2, 2))]


def test_the_kernel_is_built_and_used():
    """The README install builds oracle._fp8dequant; without it FP8 checkpoints load about five times slower."""
    assert fp8.kernel_note() is None, fp8.kernel_note()


@pytest.mark.parametrize("scale_kind", [f32_scales, ue8m0_scales])
@pytest.mark.parametrize("shape, block", CASES)
def test_kernel_equals_the_specification_bit_for_bit(shape, block, scale_kind):
    bits = every_byte(shape)
    scales = scale_kind(scale_shape(shape, block))
    ours = dequantize(bits, scales, block)
    assert np.array_equal(bits_of(ours), bits_of(spec(bits, scales, block))), (shape, block)
    assert same_values(ours, torch_dequant(bits, scales, block)), (shape, block)


def test_special_values_decode_exactly():
    """Every byte under a unit scale: both NaN encodings NaN, -0 negative zero, subnormals m * 2^-9, max 448."""
    bits = np.arange(256, dtype=np.uint8).reshape(1, 256)
    ones = np.ones((1, 2), dtype=np.float32)
    for values in (dequantize(bits, ones, (1, 128))[0], spec(bits, ones, (1, 128))[0]):
        assert np.isnan(values[list(NAN_BYTES)]).all() and np.isnan(values).sum() == 2
        assert bits_of(values[NEG_ZERO:NEG_ZERO + 1])[0] == 0x80000000 and bits_of(values[:1])[0] == 0
        assert values[SUBNORMALS].tolist() == [m * 2.0**-9 for m in range(1, 8)] + [-m * 2.0**-9 for m in range(1, 8)]
        assert values[0x7E] == 448 and values[0xFE] == -448 and values[0x38] == 1.0


def test_kernel_writes_into_rows_of_a_wider_buffer():
    """As the routed experts use it: gate and up dequantized into the two halves of one [2I, D] buffer, from byte
    rows that are a column slice of a wider array (strided rows on both sides)."""
    block = (128, 128)
    wide = every_byte((130, 300), seed=1)
    gate, up = wide[:, :257], every_byte((130, 257), seed=2)
    scales = [f32_scales(scale_shape(gate.shape, block), seed=s) for s in (3, 4)]
    buffer = np.full((260, 257), -1.0, dtype=np.float32)
    dequantize(gate, scales[0], block, out=buffer[:130])
    dequantize(up, scales[1], block, out=buffer[130:])
    assert np.array_equal(bits_of(buffer[:130]), bits_of(spec(gate, scales[0], block)))
    assert np.array_equal(bits_of(buffer[130:]), bits_of(spec(up, scales[1], block)))
    column_major = np.empty((257, 130), dtype=np.float32).T  # not row-contiguous: the specification runs instead
    dequantize(gate, scales[0], block, out=column_major)
    assert np.array_equal(bits_of(column_major), bits_of(buffer[:130]))
    with pytest.raises(ValueError, match="output buffer"):
        dequantize(gate, scales[0], block, out=np.empty((130, 257), dtype=np.float64))


def test_a_transposed_scale_grid_gives_different_output():
    """Twin: the equality above can fail. Scales indexed [col block, row block] (a square grid, so the shape check
    lets it through) change the kernel's output, and the torch reference disagrees with it."""
    shape, block = (256, 256), (128, 128)
    bits = every_byte(shape)
    bits[(bits & 0x7F) == 0x7F] = 0x11
    scales = np.array([[0.5, 2.0], [0.25, 4.0]], dtype=np.float32)
    wrong = dequantize(bits, scales.T.copy(), block)
    assert not np.array_equal(bits_of(wrong), bits_of(spec(bits, scales, block)))
    assert not same_values(wrong, torch_dequant(bits, scales, block))
    assert same_values(dequantize(bits, scales, block), torch_dequant(bits, scales, block))


def test_a_stale_kernel_is_not_used(monkeypatch, capsys):
    """A build older than the source falls back to numpy, says why once on stderr, and gives the same bits."""
    bits = every_byte((130, 257))
    scales = f32_scales(scale_shape(bits.shape, (128, 128)))
    built = dequantize(bits, scales, (128, 128))
    monkeypatch.setattr(fp8, "KERNEL_VERSION", fp8.KERNEL_VERSION + 1)
    fp8._library.cache_clear()
    fp8._note_once.cache_clear()
    try:
        assert "is stale" in fp8.kernel_note()
        fallback = [dequantize(bits, scales, (128, 128)) for _ in range(2)]
        assert capsys.readouterr().err.count("oracle._fp8dequant") == 1
        assert all(np.array_equal(bits_of(f), bits_of(built)) for f in fallback)
    finally:
        monkeypatch.undo()
        fp8._library.cache_clear()
        fp8._note_once.cache_clear()
    assert fp8.kernel_note() is None  # twin: the current build is used
