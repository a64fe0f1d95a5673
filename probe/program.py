"""`mtp-probe`'s entry point ([project.scripts]): interrupts guarded from the start (oracle/program.py)."""

from oracle.program import guard_start


def probe_main() -> None:
    guard_start()
    from probe.cli import main

    main()
