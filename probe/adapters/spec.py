"""The `--impl SPEC` grammar, in a module that imports nothing heavy: the CLI shows it in --help and, for a `c:`
library, starts the worker process (probe/adapters/cabi_process.py) before numpy and h5py are imported.
probe/run.py `adapter_from_spec` builds the adapter a SPEC names."""

from pathlib import Path

SPEC_HELP = ("c:LIB.so | python:MODULE:FACTORY | llama.cpp[-fa]:MODEL.gguf[:LIB] | torch[:cpu|cuda[:float32|bfloat16]] "
             "(torch: dense Qwen3.5 only)")


def c_library(spec: str) -> Path | None:
    """LIB of a `c:LIB` spec; None for any other kind."""
    kind, _, rest = spec.partition(":")
    return Path(rest) if kind == "c" and rest else None


def needs_checkpoint(spec: str) -> bool:
    """A llama.cpp candidate runs on its GGUF's own weights: it needs no checkpoint (but --explain does)."""
    return spec.partition(":")[0] not in ("llama.cpp", "llama.cpp-fa")
