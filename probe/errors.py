"""Errors of the probe that a user can fix; `MtpGroup` turns every one into "Error: …" and exit code 2."""

from oracle.errors import MtpError


class ProbeError(MtpError):
    """A probe input (reference, candidate, option) the user can fix; never an internal bug."""


class ReferenceTraceError(ProbeError):
    """The reference trace is readable but cannot serve as the truth (incomplete, malformed, non-finite)."""


class ToleranceError(ProbeError):
    """A tolerance option is malformed or names an unknown stage."""


class AdapterError(ProbeError):
    """An implementation under test could not be built, loaded or run (bad library, error code, crash)."""


class CandidateError(AdapterError):
    """The implementation under test itself failed (raised, crashed, exited early): the verdict is invalid."""
