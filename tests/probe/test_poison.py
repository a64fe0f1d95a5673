"""The poison pattern: told apart from computed NaNs, and preserved through HDF5 and raw files."""

import numpy as np

from oracle.trace import read_trace
from probe.poison import POISON_BITS, is_poison, poison
from tests.probe.tracekit import copy_stages, ref_data, write_h5  # noqa: F401


def test_poison_is_a_quiet_nan_with_its_own_payload():
    buf = poison((2, 3))
    assert buf.dtype == np.float32 and buf.shape == (2, 3)
    assert np.isnan(buf).all() and is_poison(buf).all()
    assert (buf.view(np.uint32) == POISON_BITS).all()


def test_computed_nans_and_numbers_are_not_poison():
    canonical = np.array([0x7FC00000, 0xFFC00000], dtype=np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        computed = np.array([np.inf, 0.0], dtype=np.float32) * np.float32(0) - np.float32(np.inf)
        computed = np.concatenate([computed, np.sqrt(np.array([-1.0], dtype=np.float32))])
    values = np.array([0.0, -0.0, 1.5, np.inf], dtype=np.float32)
    assert np.isnan(computed[0]) and np.isnan(computed[2])
    assert not is_poison(canonical).any() and not is_poison(computed).any() and not is_poison(values).any()


def test_poison_survives_hdf5_and_raw_files(tmp_path, ref_data):
    inputs, stages = ref_data
    stages = copy_stages(stages)
    stages["fc"][3] = poison(stages["fc"].shape[1])
    write_h5(tmp_path / "c.h5", inputs, stages)
    with read_trace(tmp_path / "c.h5") as reader:
        assert is_poison(reader.stage_rows("fc", 3, 4)).all()
        assert not is_poison(reader.stage_rows("fc", 2, 3)).any()
    stages["fc"].astype("<f4").tofile(tmp_path / "fc.bin")
    assert is_poison(np.fromfile(tmp_path / "fc.bin", dtype="<f4")).sum() == stages["fc"].shape[1]
