"""The digest of the routed experts a trace used (the trace's `experts.digest` attribute). Torch-free.

A MoE head's routed experts are not in the head digest (`checkpoint_digest`, sha256): a trace reads only the experts
its tokens route to, and hashing all of them would read gigabytes nobody uses. The experts a trace used are digested
on their own, part by part, as the head reads them (oracle/families/moe_experts.py) or afterwards from the files
(Checkpoint.experts_digest): the same value either way.

Two schemes, told apart by the digest's prefix. `xxh3-128/typed:` (written since the digest was found blind to a
header edit) covers each part's stored dtype and shape with its bytes: a header relabelled BF16 -> F16 gives the
same bytes other values, and must change the digest. `xxh3-128:` (traces written before) covers the bytes only;
`experts_digest_of` still computes it, so those traces can be checked in their own scheme.
"""

import xxhash

EXPERT_PARTS = ("gate", "up", "down")
TYPED, BYTES_ONLY = "xxh3-128/typed", "xxh3-128"  # the current scheme, and the one before it
SCHEMES = (TYPED, BYTES_ONLY)


def part_digest(stored, dtype: str, shape) -> str:
    """One expert part as the digest covers it: "{dtype}|{shape}|{xxh3-128 hex of its stored bytes}" (`stored`: a
    C-contiguous buffer, a mapped view or a read; `dtype`: its safetensors dtype, e.g. "BF16", "F8_E4M3"; `shape`:
    its dims, e.g. (512, 2048), joined by "x").

    Routed experts are hashed with xxh3-128, not sha256: the digest covers the experts a trace used (up to every
    expert of the layer, gigabytes), and sha256 runs at ~1.9 GB/s on one core here while xxh3 runs at ~25 GB/s, so
    that hashing them cost more than reading them (twice the export's time at Qwen3-Next scale). It is a record of
    which bytes produced the trace (accidental corruption, a different release), not a defence against forgery."""
    return part_record(dtype, shape, xxhash.xxh3_128(stored).hexdigest())


def part_record(dtype: str, shape, hexdigest: str) -> str:
    """The `part_digest` string of a part whose bytes were hashed elsewhere (e.g. streamed from the file)."""
    return f"{dtype}|{'x'.join(str(int(n)) for n in shape)}|{hexdigest}"


def scheme_of(digest: str) -> str | None:
    """The scheme a recorded `experts.digest` was written in, or None when it is neither."""
    scheme, sep, _ = digest.rpartition(":")
    return scheme if sep and scheme in SCHEMES else None


def experts_digest_of(parts: dict[tuple[int, str], str], scheme: str = TYPED) -> str:
    """The trace's `experts.digest` over `parts` ((expert, part) -> `part_digest`): "{scheme}:<hex>" over one line
    `{expert}|{part}|{part_digest}` per part (BYTES_ONLY: `{expert}|{part}|{hex}`, the bytes' hash alone), in
    expert order, parts in EXPERT_PARTS order."""
    if scheme not in SCHEMES:
        raise ValueError(f"experts digest scheme {scheme!r}: one of {SCHEMES}")
    order = {p: i for i, p in enumerate(EXPERT_PARTS)}
    keyed = sorted(parts, key=lambda k: (k[0], order[k[1]]))
    value = (lambda d: d) if scheme == TYPED else (lambda d: d.rpartition("|")[2])
    lines = "".join(f"{e}|{p}|{value(parts[(e, p)])}\n" for e, p in keyed)
    return f"{scheme}:" + xxhash.xxh3_128(lines.encode()).hexdigest()
