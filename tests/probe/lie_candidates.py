"""Python candidates (python:tests.probe.lie_candidates:FACTORY) built to make the probe lie, each a one-bug
variant of fixtures/candidates/numpy_step.py. Imported by `mtp-probe run` through the python adapter."""

import sys

import numpy as np

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "fixtures" / "candidates"))
import numpy_step  # noqa: E402  (the example candidate lives outside the package)


class NoQkNorm(numpy_step.NumpyHead):
    """q_norm and k_norm skipped: only attention at a token whose output depends on the weights can see it."""

    def attention(self, x, pos):
        original = numpy_step.rmsnorm1p  # inside attention() it is used only by q_norm and k_norm
        numpy_step.rmsnorm1p = lambda v, weight, eps: v
        try:
            return super().attention(x, pos)
        finally:
            numpy_step.rmsnorm1p = original


class ZeroOProj(numpy_step.NumpyHead):
    """An o_proj never loaded (left at zero): attn is all zeros, a value the candidate computed."""

    def __init__(self, cfg, weights):
        super().__init__(cfg, weights)
        self.w["self_attn.o_proj.weight"] = np.zeros_like(self.w["self_attn.o_proj.weight"])


class RaisesAtStep3(numpy_step.NumpyHead):
    def step(self, pos, embed_row, hidden, out, trace):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 4:
            raise ValueError("kv cache full")
        super().step(pos, embed_row, hidden, out, trace)


class ShiftedRows(numpy_step.NumpyHead):
    """The harness bug: step t's values land in row t-1 (row T-1 repeats the last step)."""

    def step(self, pos, embed_row, hidden, out, trace):
        previous = getattr(self, "previous", None)
        scratch_out, scratch = np.empty_like(out), {n: np.empty_like(r) for n, r in trace.items()}
        super().step(pos, embed_row, hidden, scratch_out, scratch)
        if previous is not None:
            previous[0][:] = scratch_out
            for name, row in previous[1].items():
                row[:] = scratch[name]
        out[:] = scratch_out
        for name, row in trace.items():
            row[:] = scratch[name]
        self.previous = (out, trace)


def no_qk_norm(config, weights):
    return NoQkNorm(config, weights)


def zero_o_proj(config, weights):
    return ZeroOProj(config, weights)


def raises_at_step_3(config, weights):
    return RaisesAtStep3(config, weights)


def raises_in_factory(config, weights):
    raise RuntimeError("weights not found: mtp.fc.weight")


def shifted_rows(config, weights):
    return ShiftedRows(config, weights)


class ExitsAtStep3(numpy_step.NumpyHead):
    """A candidate that ends the process with success mid-run (red team: the probe exited 0 with no verdict)."""

    def step(self, pos, embed_row, hidden, out, trace):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 4:
            sys.exit(0)
        super().step(pos, embed_row, hidden, out, trace)


class CapturesThroughAGenerator(numpy_step.NumpyHead):
    """`capture` as a one-shot iterable: the stages it lists must still be captured."""

    @property
    def capture(self):
        return (name for name in ("attn", "mlp"))


def exits_at_step_3(config, weights):
    return ExitsAtStep3(config, weights)


def exits_in_factory(config, weights):
    sys.exit(0)


def captures_through_a_generator(config, weights):
    return CapturesThroughAGenerator(config, weights)


class CancelledAtStep3(numpy_step.NumpyHead):
    """An async engine's asyncio.CancelledError (a BaseException, not an Exception) leaking from step (red team: the
    probe ended with exit 1, "diverged", having compared nothing)."""

    def step(self, pos, embed_row, hidden, out, trace):
        import asyncio

        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 4:
            raise asyncio.CancelledError("engine loop shut down")
        super().step(pos, embed_row, hidden, out, trace)


def cancelled_at_step_3(config, weights):
    return CancelledAtStep3(config, weights)


def generator_exit_in_factory(config, weights):
    raise GeneratorExit("closed")


class CaptureRaises(numpy_step.NumpyHead):
    @property
    def capture(self):
        raise RuntimeError("capture list not ready")


class CaptureIsNone(numpy_step.NumpyHead):
    capture = None


class CaptureIsANumber(numpy_step.NumpyHead):
    capture = 5


class StepPropertyRaises(numpy_step.NumpyHead):
    @property
    def step(self):
        raise RuntimeError("step kernel not compiled")


def capture_raises(config, weights):
    return CaptureRaises(config, weights)


def capture_is_none(config, weights):
    return CaptureIsNone(config, weights)


def capture_is_a_number(config, weights):
    return CaptureIsANumber(config, weights)


def step_property_raises(config, weights):
    return StepPropertyRaises(config, weights)
