"""The one protocol every implementation under test satisfies, and the checks that apply to all of them.

An adapter turns the reference's recorded inputs (token ids, embedding rows, hidden, positions) plus the
checkpoint's head weights into stage rows. It converts layout and dtype to the oracle's convention and does nothing
else: no comparing, no tolerances, no printing. Poisoning, write coverage and shapes are checked once, by the
probe, for every adapter alike.
"""

from typing import Protocol

import numpy as np

from oracle.trace import TraceInputs


class Adapter(Protocol):
    name: str
    deterministic: bool  # False: two runs on the same inputs may differ (the report says so)
    weights_digest: str | None  # digest (oracle.checkpoint.HeadWeights) of the head weights it ran with

    def run(self, inputs: TraceInputs) -> dict[str, np.ndarray]:
        """Stage name -> float32 [T, width] for the stages this implementation exposes (keys ⊆ STAGES,
        `out` included when it computes the head output). Rows never written keep the poison pattern."""
        ...
