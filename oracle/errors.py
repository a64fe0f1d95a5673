"""Errors a user can fix, and their translation at the CLI edge.

Library code raises `MtpError` subclasses; `MtpGroup` (the click group of both CLIs) turns them into
"Error: <message>" and exit code 2, so an input problem is never mistaken for a divergence (exit 1). Anything else
is a bug and keeps its traceback. Every message says what is wrong, where (file, tensor, row) and what to do.
"""

import click


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


class UserError(click.ClickException):
    exit_code = 2


class MtpGroup(click.Group):
    """A click group whose commands report MtpError as a message with exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MtpError as err:
            raise UserError(str(err)) from None
