"""The family registry: which family a checkpoint's config.json describes (model_type at the top level or in
`text_config`, else `architectures`). Imports no torch: the probe and `inspect` use it."""

from oracle.errors import CheckpointError
from oracle.families import (deepseek_v3_layout, deepseek_v4_layout, glm4_moe_layout, mimo_v2_flash_layout,
                              mtp_model_layout, qwen3_5_layout, qwen3_5_moe_layout, qwen3_next_layout)
from oracle.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    qwen3_5_layout.SPEC, qwen3_5_moe_layout.SPEC, qwen3_next_layout.SPEC, deepseek_v3_layout.SPEC,
    glm4_moe_layout.SPEC, deepseek_v4_layout.SPEC, *mtp_model_layout.SPECS, mimo_v2_flash_layout.SPEC)}


def supported() -> str:
    return ", ".join(f"{name} (model_type {' / '.join(spec.model_types)})" for name, spec in FAMILIES.items())


def detect(raw: dict, source: str) -> FamilySpec:
    """The family of a config.json dict; CheckpointError listing the supported ones when none matches."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    types = [t for t in (text.get("model_type"), raw.get("model_type")) if isinstance(t, str)]
    for model_type in types:
        for spec in FAMILIES.values():
            if model_type in spec.model_types:
                return spec
    architectures = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    for spec in FAMILIES.values():
        if any(a in spec.architectures for a in architectures):
            return spec
    found = f"model_type {' / '.join(map(repr, types))}" if types else "no model_type"
    raise CheckpointError(f"{source}: {found}{f', architectures {architectures}' if architectures else ''} is not a "
                          f"supported MTP family. Supported: {supported()}.")


def family(name: str) -> FamilySpec:
    """The family called `name` (e.g. a trace's `family` attribute)."""
    if name not in FAMILIES:
        raise CheckpointError(f"unknown family {name!r}; supported: {supported()}.")
    return FAMILIES[name]


def head_module(spec: FamilySpec):
    """The family's torch half (build_head, run_batched, run_stepwise, attention_with_uniform_weights,
    load_main_model, main_model_hidden, torch_weights; optionally embedding_rows, where the head has its own table,
    and main_lm_head_input, where H is not itself the main lm_head's input), imported on first use: only the
    detected family's transformers modules are loaded. Every head it builds answers `steps(rotary, embed, hidden,
    positions, mask, cache)`, the call `accept` drafts through."""
    import importlib

    return importlib.import_module(spec.head_module)
