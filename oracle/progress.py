"""Progress on stderr for long work: export, accept, `mtp-probe run`, diff and selftest.

A command turns it on with `reporting(enabled=not quiet)`; library calls stay silent unless a caller does so.
On a terminal each tracked loop is a tqdm bar (steps done, rate, ETA); when stderr is not a terminal (a log
file, CI) it prints one final timing line per loop instead, and a heartbeat line every HEARTBEAT_S seconds while
a loop runs longer than that (a CI log that stays silent for minutes reads as a hang). torch-free, so the probe
may use it too.
"""

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

_ENABLED = contextvars.ContextVar("mtp_progress_enabled", default=False)
_ACTIVE_BARS: list = []  # tqdm bars on screen: log lines go through tqdm.write so they do not tear them
HEARTBEAT_S = 10.0  # seconds between "still working" lines on a non-terminal stderr


@contextlib.contextmanager
def reporting(enabled: bool = True) -> Iterator[None]:
    """Show progress (on stderr) for the work done inside this block; `enabled=False` is `-q`."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def say(message: str) -> None:
    """One log line on stderr that leaves a progress bar on screen intact."""
    if _ACTIVE_BARS:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)


def timing_line(desc: str, done: int, total: int | None, unit: str, seconds: float) -> str:
    """`export: 8/8 steps in 0.42 s (19.0 steps/s)`: what a non-terminal stderr gets when a loop ends."""
    count = f"{done}/{total}" if total is not None and total != done else f"{done}"
    units = unit if done == 1 else f"{unit}s"
    per_second = done / seconds if seconds > 0 else 0.0
    rate = f" ({per_second:.0f} {unit}s/s)" if per_second >= 100 else f" ({per_second:.3g} {unit}s/s)" if done else ""
    return f"{desc}: {count} {units} in {seconds:.2f} s{rate}"


def heartbeat_line(desc: str, done: int, total: int | None, unit: str, seconds: float) -> str:
    """`export (stepwise): 40/100 steps after 10 s, still running`: a non-terminal stderr's sign of life."""
    count = f"{done}/{total}" if total is not None else f"{done}"
    return f"{desc}: {count} {unit}s after {seconds:.0f} s, still running"


class Progress:
    """`with Progress("export", total=T) as bar: ... bar.update()`; does nothing unless `reporting` is on."""

    def __init__(self, desc: str, total: int | None, unit: str = "step"):
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0
        self._start = time.perf_counter()
        self._enabled = _ENABLED.get()
        self._bar = None
        if self._enabled and _is_terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True,
                             **({"dynamic_ncols": True} if _has_width() else {"ncols": 80, "nrows": 24}))
            _ACTIVE_BARS.append(self._bar)
        self._stop, self._beat = threading.Event(), None
        if self._enabled and self._bar is None:  # a log: a line every HEARTBEAT_S while the loop runs
            self._beat = threading.Thread(target=self._heartbeat, name=f"progress {desc}", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        interval = HEARTBEAT_S
        while not self._stop.wait(interval):
            print(heartbeat_line(self.desc, self.done, self.total, self.unit, time.perf_counter() - self._start),
                  file=sys.stderr, flush=True)

    @property
    def shown(self) -> bool:
        """Whether this loop's progress is reported at all (reporting on, not closed)."""
        return self._enabled

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self, finished: bool = True) -> None:
        """End the loop: the bar stays on screen; elsewhere one timing line (none when it ended by an error)."""
        if not self._enabled:
            return
        self._enabled = False
        self._stop.set()
        if self._beat is not None:
            self._beat.join()  # its last line, if one is being printed, comes before the timing line
        if self._bar is not None:
            _ACTIVE_BARS.remove(self._bar)
            self._bar.close()
        elif finished:
            print(timing_line(self.desc, self.done, self.total, self.unit, time.perf_counter() - self._start),
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)


def tracked(items: Iterable, desc: str, total: int | None, unit: str = "step",
            count: Callable[[object], int] = lambda item: 1) -> Iterator:
    """Yield `items`, advancing a Progress by `count(item)` after each. A loop left early (a break, an error) closes
    the bar without a timing line: the generator cannot tell which, and a line after an error message misleads."""
    bar = Progress(desc, total, unit)
    finished = False
    try:
        for item in items:
            yield item
            bar.update(count(item))
        finished = True
    finally:
        bar.close(finished)


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _has_width() -> bool:
    """A terminal that reports its width (a pty opened without a size reports 0 columns: tqdm would draw nothing)."""
    import os

    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):
        return False
