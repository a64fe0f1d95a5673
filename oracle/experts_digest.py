"""The digest of the routed experts a trace used (the trace's `experts.digest` attribute). Torch-free.

A MoE head's routed experts are not in the head digest (`checkpoint_digest`, sha256): a trace reads only the experts
its tokens route to, and hashing all of them would read gigabytes nobody uses. The experts a trace used are digested
on their own, part by part, as the head reads them (oracle/families/moe_experts.py) or afterwards from the files
(Checkpoint.experts_digest): the same value either way.
"""

import xxhash

EXPERT_PARTS = ("gate", "up", "down")


def part_digest(stored) -> str:
    """xxh3-128 (hex) of one expert part's stored bytes (a C-contiguous buffer: a mapped view or a read).

    Routed experts are hashed with xxh3-128, not sha256: the digest covers the experts a trace used (up to every
    expert of the layer, gigabytes), and sha256 runs at ~1.9 GB/s on one core here while xxh3 runs at ~25 GB/s, so
    that hashing them cost more than reading them (twice the export's time at Qwen3-Next scale). It is a record of
    which bytes produced the trace (accidental corruption, a different release), not a defence against forgery."""
    return xxhash.xxh3_128(stored).hexdigest()


def experts_digest_of(parts: dict[tuple[int, str], str]) -> str:
    """The trace's `experts.digest`: "xxh3-128:<hex>" over one line `{expert}|{part}|{part_digest}` per part, in
    expert order, parts in EXPERT_PARTS order."""
    order = {p: i for i, p in enumerate(EXPERT_PARTS)}
    lines = "".join(f"{e}|{p}|{parts[(e, p)]}\n" for e, p in sorted(parts, key=lambda k: (k[0], order[k[1]])))
    return "xxh3-128:" + xxhash.xxh3_128(lines.encode()).hexdigest()
