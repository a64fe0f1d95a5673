"""Errors a user can fix, and their translation at the CLI edge.

Library code raises `MtpError` subclasses; `MtpGroup` (the click group of both CLIs) turns them into
"Error: <message>" and exit code 2, so an input problem is never mistaken for a divergence (exit 1). Anything else
is a bug: its traceback and exit code 4. An interrupt exits 128 + signal (130 for Ctrl-C). Every message says what
is wrong, where (file, tensor, row) and what to do.
"""

import io
import os
import signal
import sys
import threading
import traceback

import click

from oracle.text import printable


class MtpError(Exception):
    """A problem with the user's input (files, options, checkpoint); never an internal bug."""


class CheckpointError(MtpError):
    """The checkpoint directory, its config.json or its safetensors do not match what the head needs."""


class InputError(MtpError):
    """Token ids, hidden states or positions given to the oracle are unusable."""


class TraceFormatError(MtpError):
    """A trace file or raw trace directory is not a readable `mtp-trace/1` trace."""


class OutputError(MtpError):
    """The output path cannot be written."""


EXIT_INTERNAL = 4  # a bug in mtp-probe itself: never 1, which means "diverged"
_INTERNAL_NOTE = "internal error: this is a bug in mtp-probe; please report it with the traceback above."


class UserError(click.ClickException):
    exit_code = 2


class MtpGroup(click.Group):
    """The click group of both CLIs: exit 2 for an MtpError, 4 (with its traceback) for any other exception,
    128 + signal for an interrupt. Nothing else may exit 1: it is the "diverged" verdict.

    click's standalone mode would turn KeyboardInterrupt (and click.Abort, EOFError) into exit 1 and let other
    exceptions escape as Python's exit 1, so both are caught here first: in `invoke` (the command) and in `main`
    (whatever happens around it, e.g. while parsing)."""

    def invoke(self, ctx: click.Context):
        from oracle.output import published_at_end  # the command's outputs are put in place when it ends

        try:
            with published_at_end(before_publishing=self._over):
                return super().invoke(ctx)
        except MtpError as err:
            message = printable(str(err), keep_lines=True)  # it may quote a file's strings
            if getattr(err, "verdict_line_printed", False) and _one_stream():
                # `INVALID | <first line>` is on stdout already and stdout is where stderr goes (a terminal, 2>&1):
                # print only what that line left out, not the same sentence twice
                rest = message.partition("\n")[2]
                if rest:
                    click.echo(rest, err=True)
                ctx.exit(UserError.exit_code)
            raise UserError(message) from None
        except (click.exceptions.Exit, click.ClickException):
            raise
        except (KeyboardInterrupt, click.Abort):
            _echo_interrupted(signal.SIGINT)
            ctx.exit(128 + signal.SIGINT)
        except BrokenPipeError:  # stdout closed by the reader (`| head`): the shell's status for SIGPIPE, quietly
            _silence_stdout()
            ctx.exit(128 + signal.SIGPIPE)
        except SystemExit:
            raise
        except BaseException:  # a bug of ours, not an input problem: say so, with the traceback (a BaseException
            traceback.print_exc()  # such as asyncio.CancelledError would otherwise end the process with exit 1)
            click.echo(_INTERNAL_NOTE, err=True)
            ctx.exit(EXIT_INTERNAL)

    def _over(self) -> None:
        """The command is over and its outputs are about to be put in place: as the program, an interrupt from here
        on is ignored (it would end the process with 130 once they had been replaced)."""
        if getattr(self, "_owns_process", False):
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        self._owns_process = _owns_the_process(args, kwargs)
        if _owns_the_process(args, kwargs):
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, _end_now)
        try:
            return super().main(*args, standalone_mode=True, **kwargs)
        except SystemExit as done:
            if _owns_the_process(args, kwargs):
                # The command is over and its exit code says what happened to its output; a Ctrl-C arriving
                # while Python tears down (torch can take a while) must not turn that into a killed process.
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                _exit_without_teardown(done.code)
            raise
        except KeyboardInterrupt:  # outside the command, where click would report it as exit 1
            _echo_interrupted(signal.SIGINT)
            sys.exit(128 + signal.SIGINT)
        except BaseException:  # not only Exception: nothing may end the process with exit 1 but "diverged"
            traceback.print_exc()
            click.echo(_INTERNAL_NOTE, err=True)
            sys.exit(EXIT_INTERNAL)

    def make_context(self, *args, **kwargs) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:  # click would turn it into Abort, exit 1
            _echo_interrupted(signal.SIGINT)
            raise click.exceptions.Exit(128 + signal.SIGINT) from None


def _one_stream() -> bool:
    """Whether stdout and stderr reach the same place (one terminal, one pipe or file, or an in-process runner that
    captures both): then a line on stdout needs no copy on stderr. Separate files each get the message."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return True  # no file descriptors: captured in-process (click's CliRunner), both read together
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


def _end_now(signum, frame) -> None:
    """The program's SIGINT/SIGTERM handler: remove unfinished outputs and end with 128 + signal at once.

    Raising KeyboardInterrupt from here could land inside a C++ callback into Python (torch's pybind11), where it
    cannot propagate and aborts the process (SIGABRT, exit -6: measured with a Ctrl-C 2.5 s into an export). A
    write in progress holds the signal itself until its file is gone (oracle/output.py atomic_output)."""
    from oracle.output import remove_pending

    remove_pending()
    _echo_interrupted(signum)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


def _owns_the_process(args: tuple, kwargs: dict) -> bool:
    """True when run as the program (arguments from sys.argv), not in-process (click's CliRunner, a library)."""
    given = args[0] if args else kwargs.get("args")
    return given is None and threading.current_thread() is threading.main_thread()


def _exit_without_teardown(code) -> None:
    """End the program as Python's exit would (atexit handlers run, stdout and stderr are flushed, the same exit
    status) but without tearing down every loaded module: after torch and transformers that teardown alone takes
    over a second on a 2-core machine, and by now the command's output is complete (files are written through
    atomic_output and closed). Returns, so that Python exits normally, while another non-daemon thread runs."""
    if any(not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        return  # Python's exit joins it
    import atexit

    atexit._run_exitfuncs()
    if code is None or isinstance(code, int):
        status = code or 0
    else:  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed reader: Python's own exit says 120
            status = status or 120
    os._exit(status)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # not a real file descriptor (in-process runs): nothing will flush it


def _echo_interrupted(signum: int) -> None:
    click.echo(f"\nInterrupted ({signal.Signals(signum).name}); unfinished output files were removed.", err=True)
