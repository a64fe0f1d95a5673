"""The trace's `experts.digest`: hashed part by part as the head reads the routed experts, equal to the digest of
the same experts read back from the files, and changed by one flipped byte in an expert the trace used (and only
there: an expert no token routes to is not in it)."""

import shutil
from pathlib import Path
import sys

import numpy as np
import pytest

from oracle.checkpoint import Checkpoint
from oracle.experts_digest import BYTES_ONLY, EXPERT_PARTS, TYPED, experts_digest_of, part_digest, scheme_of
from oracle.export import HiddenSource, export_trace
from oracle.trace import read_trace
from tests.helpers import ROOT, load_script

FIXTURES = load_script("make_fixtures")
sys.path.insert(0, str(ROOT / "scripts"))
TOKENS = np.array([5, 17, 3, 99, 200, 7, 42, 5, 300, 11], dtype=np.int64)


def _moe(root, family, layout):
    return FIXTURES.write_moe_checkpoint(root, family, layout, main_model=False)


CASES = {
    "qwen3_5_moe_per_expert": lambda root: _moe(root, "qwen3_5_moe", "per_expert"),
    "qwen3_next_fused": lambda root: _moe(root, "qwen3_next", "fused"),
    "deepseek_v3_fp8": lambda root: FIXTURES.write_mtp_layer_checkpoint(root, family="deepseek_v3",
                                                                         fp8_block=[16, 32]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts_digest")
    return {name: make(root / name) for name, make in CASES.items()}


def exported(ckpt, out, mode="batched", tokens=TOKENS) -> tuple[list[int], str]:
    export_trace(ckpt, out, tokens, HiddenSource(seed=0), mode=mode)
    with read_trace(out) as reader:
        experts = reader.attrs["experts"]
    return experts["used"], experts["digest"]


def flip_byte(ckpt, expert: int, part: str) -> None:
    """Flip the lowest bit of one byte in the middle of `expert`'s stored `part`, in place."""
    checkpoint = Checkpoint(ckpt)
    extents = dict(checkpoint._expert_extents(checkpoint.layout().experts, expert))
    path, offset, nbytes = extents[part]
    with open(path, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)[0]
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("mode", ["batched", "stepwise"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_digest_hashed_while_reading_equals_the_files_digest(checkpoints, tmp_path, name, mode):
    used, digest = exported(checkpoints[name], tmp_path / "t.h5", mode)
    assert digest.startswith("xxh3-128/typed:") and scheme_of(digest) == TYPED
    assert digest == Checkpoint(checkpoints[name]).experts_digest(used)  # every part read back from the files


@pytest.mark.parametrize("name", list(CASES))
def test_twin_one_flipped_byte_in_a_used_expert_changes_the_digest(checkpoints, tmp_path, name):
    used, digest = exported(checkpoints[name], tmp_path / "before.h5", tokens=TOKENS[:1])  # some experts unused
    num_experts = Checkpoint(checkpoints[name]).layout().experts.num_experts
    unused = sorted(set(range(num_experts)) - set(used))
    for expert, part, changes in ((used[-1], "down", True), (used[0], "gate", True), (unused[0], "up", False)):
        copy = shutil.copytree(checkpoints[name], tmp_path / f"{expert}_{part}")
        flip_byte(copy, expert, part)
        used_after, after = exported(copy, tmp_path / f"{expert}_{part}.h5", tokens=TOKENS[:1])
        assert used_after == used  # a low bit in one weight: the same routing
        assert (after != digest) is changes, (expert, part)
        assert after == Checkpoint(copy).experts_digest(used)


def test_parts_already_hashed_are_taken_as_given_and_the_rest_read(checkpoints):
    checkpoint = Checkpoint(checkpoints["qwen3_next_fused"])
    full = checkpoint.experts_digest([0, 1])
    stored = dict(checkpoint.expert_parts(checkpoint.layout().experts, 0))
    known = {(0, p): part_digest(stored[p].copy(), "BF16", stored[p].shape) for p in EXPERT_PARTS}
    assert checkpoint.experts_digest([0, 1], known) == full
    wrong = known | {(0, "down"): "0" * 32}  # a part given wrongly is taken as given: the caller's word
    assert checkpoint.experts_digest([0, 1], wrong) != full
    assert experts_digest_of({(1, "up"): "a", (0, "down"): "b"}) == experts_digest_of({(0, "down"): "b", (1, "up"): "a"})


def relabel(ckpt, tensor: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in its shard's safetensors header, in place (same header length, bytes unchanged)."""
    import json
    import struct

    entry = Checkpoint(ckpt).entry(tensor)
    with open(entry.file, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header[tensor]["dtype"] = dtype
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= length
        f.seek(8)
        f.write(text.ljust(length))


def test_twin_a_header_relabelled_bf16_to_f16_changes_the_digest(checkpoints, tmp_path):
    """The same bytes read as another dtype are other weights: the typed digest sees the label, as the dense head
    digest does (the bytes-only scheme could not)."""
    used, digest = exported(checkpoints["qwen3_5_moe_per_expert"], tmp_path / "before.h5", tokens=TOKENS[:1])
    copy = shutil.copytree(checkpoints["qwen3_5_moe_per_expert"], tmp_path / "relabelled")
    layout = Checkpoint(copy).layout().experts
    relabel(copy, layout.names["down"].format(e=used[0]), "F16")
    after = Checkpoint(copy).experts_digest(used)
    assert after != digest
    assert Checkpoint(copy).experts_digest(used, scheme=BYTES_ONLY) == Checkpoint(
        checkpoints["qwen3_5_moe_per_expert"]).experts_digest(used, scheme=BYTES_ONLY)  # blind to it, as it was


def test_a_digest_written_before_the_typed_scheme_is_recomputed_in_its_own_scheme(checkpoints):
    """Traces written before record `xxh3-128:` over `{expert}|{part}|{hex}` lines: still computed, so they can
    still be checked; the scheme is read from the recorded prefix."""
    import xxhash

    checkpoint = Checkpoint(checkpoints["qwen3_next_fused"])
    stored = dict(checkpoint.expert_parts(checkpoint.layout().experts, 2))
    lines = "".join(f"2|{p}|{xxhash.xxh3_128(stored[p].copy()).hexdigest()}\n" for p in EXPERT_PARTS)
    legacy = "xxh3-128:" + xxhash.xxh3_128(lines.encode()).hexdigest()  # the definition before the typed scheme
    assert checkpoint.experts_digest([2], scheme=scheme_of(legacy)) == legacy
    assert scheme_of(legacy) == BYTES_ONLY and scheme_of("sha256:" + "0" * 64) is None
    assert checkpoint.experts_digest([2]) != legacy
    with pytest.raises(ValueError):
        experts_digest_of({}, "md5")


def test_an_unreadable_shard_is_a_checkpoint_error_naming_it(checkpoints, tmp_path):
    """Hashing experts from the files (run's experts check): a shard that cannot be opened is exit-2 material, named;
    never an OSError traceback."""
    from oracle.errors import CheckpointError

    copy = shutil.copytree(checkpoints["qwen3_5_moe_per_expert"], tmp_path / "ckpt")
    checkpoint = Checkpoint(copy)
    path = Path(checkpoint._expert_extents(checkpoint.layout().experts, 0)[0][1][0])
    checkpoint.layout()  # headers read while the file is there
    path.unlink()
    path.mkdir()  # cannot be opened as a file (IsADirectoryError), even by root (a mode-000 file could)
    with pytest.raises(CheckpointError, match=f"{path.name}: reading routed expert 0 failed"):
        checkpoint.experts_digest([0])
