"""Python candidates (python:tests.probe.fault_candidates:FACTORY) whose code acts outside its steps, to forge the
verdict line, end, stall or move the probe: each is fixtures/candidates/numpy_step.py (correct, or with o_proj
zeroed, which must fail) plus one such act."""

import atexit
import os
import sys
import threading
import time

import numpy as np

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "fixtures" / "candidates"))
import numpy_step  # noqa: E402  (the example candidate lives outside the package)

FORGED = "PASSED | 11 stages x 8 tokens within tolerance | forged by the candidate"


def _zeroed_o_proj(head):
    head.w["self_attn.o_proj.weight"] = np.zeros_like(head.w["self_attn.o_proj.weight"])
    return head


def _forge_at_exit():
    atexit.register(lambda: print(FORGED, flush=True))


def _forge_from_a_thread(forever: bool = False, forge: bool = True):
    """A non-daemon thread that prints the forged line once the main thread has ended (after the verdict), and
    then, with `forever`, never ends: Python's exit waits for it. With `forge=False` it only outlives the main
    thread, so that the interpreter tears down (and runs finalizers) after the verdict."""
    main = threading.main_thread()

    def late():
        main.join()
        if forge:
            print(FORGED, flush=True)
        while forever:
            time.sleep(0.1)

    threading.Thread(target=late, daemon=False).start()


class _ForgesWhenFreed:
    def __del__(self):
        print(FORGED, flush=True)


_KEPT = []  # freed only when the interpreter tears down


def atexit_forges(config, weights):
    _forge_at_exit()
    return numpy_step.make_head(config, weights)


def atexit_forges_wrong(config, weights):
    _forge_at_exit()
    return _zeroed_o_proj(numpy_step.make_head(config, weights))


def thread_forges_wrong(config, weights):
    _forge_from_a_thread()
    return _zeroed_o_proj(numpy_step.make_head(config, weights))


def thread_never_ends(config, weights):
    _forge_from_a_thread(forever=True)
    return numpy_step.make_head(config, weights)


def del_forges_wrong(config, weights):
    _KEPT.append(_ForgesWhenFreed())
    _forge_from_a_thread(forge=False)
    return _zeroed_o_proj(numpy_step.make_head(config, weights))


class _ExitsAtStep2(numpy_step.NumpyHead):
    def step(self, pos, embed_row, hidden, out, trace):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            os._exit(0)
        super().step(pos, embed_row, hidden, out, trace)


def os_exit_at_step_2(config, weights):
    return _ExitsAtStep2(config, weights)


class _Chatty(numpy_step.NumpyHead):
    """Prints at every step, and once a line meant to clear the screen and pass for the verdict."""

    def step(self, pos, embed_row, hidden, out, trace):
        print(f"step at position {pos}")
        if pos == 0:
            print("\x1b[2J\r" + FORGED, file=sys.stderr)
        super().step(pos, embed_row, hidden, out, trace)


def chatty(config, weights):
    return _Chatty(config, weights)


def chatty_wrong(config, weights):
    return _zeroed_o_proj(_Chatty(config, weights))


def chdir_in_factory(config, weights):
    """Changes the working directory (to MTP_TEST_CHDIR) before its steps, as some engines' loaders do."""
    os.chdir(os.environ["MTP_TEST_CHDIR"])
    return numpy_step.make_head(config, weights)


class _Floods(numpy_step.NumpyHead):
    def step(self, pos, embed_row, hidden, out, trace):
        print("x" * 50_000)  # 400 000 characters over the 8 steps
        super().step(pos, embed_row, hidden, out, trace)


def floods(config, weights):
    return _Floods(config, weights)
