"""`--main-model` for the DeepSeek-V3, GLM-4.5 and DeepSeek-V4 families: the checkpoint's main layers loaded into
transformers' official base model (`DeepseekV3Model`, `Glm4MoeModel`, `DeepseekV4Model`) in float32.

What it is: a strict loader. Checkpoint names are mapped onto the model's parameters by transformers' own
conversion mapping for the model type (`get_checkpoint_conversion_mapping`; DeepSeek-V4's release names
`layers.N.attn.wq_a.weight` -> `layers.N.self_attn.q_a_proj.weight`, ...), and the per-expert tensors are stacked
as its MergeModulelist + Concatenate converters stack them (`gate_up_proj` [E, 2I, D]: gate rows, then up;
`down_proj` [E, D, I]). FP8 weights are dequantized with their block scales (oracle/fp8.py). A parameter the
checkpoint lacks is refused, naming the checkpoint tensor, and so is a main-model tensor nothing reads.
What it is not: a memory-lean loader. The whole main model is widened to float32 in memory, which suits small models
and tiny fixtures; a real DeepSeek main model does not fit on one machine: dump H from an engine and pass --hidden.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming, rename_source_key

from oracle.checkpoint import Checkpoint
from oracle.errors import CheckpointError
from oracle.fp8 import dequantize
from oracle.text import clipped

EXPERT = re.compile(r"^(?P<stem>.*\.experts)\.(?P<e>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass(frozen=True)
class MainLayout:
    """How one family stores its main model."""

    model_type: str  # the key of transformers' conversion mapping
    is_main: Callable[[str], bool]  # a checkpoint tensor of the main model (not the MTP layer, not the lm_head)
    strip: str  # prefix removed before renaming ("model." in the HF layout; "" in DeepSeek-V4's release)
    scale_of: Callable[[str], str]  # FP8 weight name -> its block scale's name
    expert_name: Callable[[str, int, str], str]  # (module stem `layers.N.mlp.experts`, e, gate|up|down) -> ckpt name


def _renamings(model_type: str) -> list[WeightRenaming]:
    return [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]


def module_name(layout: MainLayout, name: str, renamings: list[WeightRenaming]) -> str:
    """A checkpoint name as the base model's parameter name (experts still per expert)."""
    return rename_source_key(name.removeprefix(layout.strip), renamings, [])[0]


def checkpoint_name(layout: MainLayout, module: str) -> str:
    """The checkpoint name a missing parameter would have had: transformers' reverse renaming, kept only where it
    maps forward again onto the same parameter (else the parameter's own name)."""
    renamings = _renamings(layout.model_type)
    guess = layout.strip + rename_source_key(module, [t.reverse_transform() for t in renamings][::-1], [],
                                             reverse=True)[0]
    return guess if module_name(layout, guess, renamings) == module else module


# safetensors dtype names -> torch dtypes (what a main model's tensors may be stored as)
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
                 "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
                 "BOOL": torch.bool}


class _Reader:
    """Checkpoint tensors as torch tensors (any dtype: FP8, E8M0 scales, integer tables), read with pread
    (Checkpoint.stored_bytes): safetensors' own reader maps the shard, and a shard cut short while the main model
    loads was a SIGBUS."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __call__(self, name: str) -> torch.Tensor:
        entry = self.ckpt.entry(name)
        dtype = _TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{name} in {entry.file.name} is {entry.dtype}; the main model reader handles "
                                  f"{', '.join(k for k, v in _TORCH_DTYPES.items() if v is not None)}.")
        stored = self.ckpt.stored_bytes(name)
        if not stored:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(stored, dtype=dtype).reshape(entry.shape)


def _value(read: _Reader, layout: MainLayout, name: str, block: tuple[int, int]) -> torch.Tensor:
    """A main tensor as the model means it: FP8 dequantized with its scale, bf16/f16 widened, integers as stored."""
    t = read(name)
    if t.dtype == torch.float8_e4m3fn:
        scale = layout.scale_of(name)
        if scale not in read.ckpt.names():
            raise CheckpointError(f"{name} is F8_E4M3 without its block scale {scale} beside it; the checkpoint is "
                                  f"inconsistent.")
        return torch.from_numpy(dequantize(t.view(torch.uint8).numpy(), read(scale).float().numpy(), block, name))
    return t.float() if t.is_floating_point() else t


def main_state(ckpt: Checkpoint, layout: MainLayout) -> dict[str, torch.Tensor]:
    """{base-model parameter name: value} for every main-model tensor of the checkpoint (experts stacked)."""
    renamings, read = _renamings(layout.model_type), _Reader(ckpt)
    block = tuple(getattr(ckpt.config, "weight_block_size", None) or (128, 128))
    names = [n for n in ckpt.names() if layout.is_main(n)]
    scales = {layout.scale_of(n) for n in names if n.endswith("weight")} & set(names)
    state, experts = {}, {}
    for name in names:
        if name in scales:
            continue
        target = module_name(layout, name, renamings)
        match = EXPERT.match(target)
        if match:
            experts.setdefault(match["stem"], {})[(int(match["e"]), PART[match["part"]])] = name
        else:
            state[target] = _value(read, layout, name, block)
    for stem, parts in experts.items():
        state |= _stacked(read, layout, stem, parts, block)
    return state


def _stacked(read: _Reader, layout: MainLayout, stem: str, parts: dict, block) -> dict[str, torch.Tensor]:
    """One MoE block's per-expert tensors as the fused `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]."""
    count = 1 + max(e for e, _ in parts)
    missing = [layout.expert_name(stem, e, p) for e in range(count) for p in ("gate", "up", "down")
               if (e, p) not in parts]
    if missing:
        raise CheckpointError(f"{read.ckpt.path}: the main model's experts under {stem} are incomplete: missing "
                              f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}.")
    value = {(e, p): _value(read, layout, parts[(e, p)], block) for e in range(count) for p in ("gate", "up", "down")}
    return {f"{stem}.gate_up_proj": torch.stack([torch.cat([value[(e, "gate")], value[(e, "up")]])
                                                 for e in range(count)]),
            f"{stem}.down_proj": torch.stack([value[(e, "down")] for e in range(count)])}


def load_main_model(ckpt: Checkpoint, model_class: type, config, layout: MainLayout,
                    rotary_class: type) -> nn.Module:
    """The official base model (float32, eager) with every parameter from the checkpoint's main tensors."""
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    with torch.device("meta"):
        model = model_class(config)
    expected = model.state_dict()
    state = main_state(ckpt, layout)
    if set(expected) != set(state):
        raise CheckpointError(_mismatch(ckpt, model_class, layout, set(expected), set(state)))
    state = {n: v if v.is_floating_point() else v.to(expected[n].dtype) for n, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:  # shapes: the checkpoint and config.json disagree
        raise CheckpointError(f"{ckpt.path}: the main model's tensors do not fit {model_class.__name__} built from "
                              f"config.json: {clipped(str(err))}") from None
    _rebuild_rotaries(model, config, rotary_class)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"main-model tensors never loaded: {left[:5]}")  # a bug: strict loading prevents it
    return model.eval()


def _rebuild_rotaries(model: nn.Module, config, rotary_class: type) -> None:
    """Rotary embeddings hold only computed (non-persistent) buffers: built for real, never loaded."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, rotary_class):
                setattr(parent, name, rotary_class(config))


def _mismatch(ckpt: Checkpoint, model_class: type, layout: MainLayout, expected: set[str], state: set[str]) -> str:
    def some(names):
        return ", ".join(names[:3]) + (f" … ({len(names)} in all)" if len(names) > 3 else "")

    missing, unexpected = sorted(expected - state), sorted(state - expected)
    parts = []
    if missing:
        named = [layout.expert_name(m.rsplit(".", 1)[0], 0, "down" if m.endswith("down_proj") else "gate")
                 if m.endswith((".experts.gate_up_proj", ".experts.down_proj")) else checkpoint_name(layout, m)
                 for m in missing]
        parts.append(f"missing {some(named)}")
    if unexpected:
        parts.append(f"tensors no parameter of {model_class.__name__} reads: {some(unexpected)} (their "
                     f"{model_class.__name__} names)")
    held = f"it holds {len(expected & state)} of the main model's {len(expected)} parameters; "
    return (f"{ckpt.path}: --main-model builds the main model ({model_class.__name__}, transformers' conversion "
            f"mapping for {layout.model_type}) from the checkpoint's main layers, and they do not match: {held}"
            f"{'; '.join(parts)}. A checkpoint of the MTP layer alone cannot run the main model: dump the hidden "
            f"from your engine and pass --hidden FILE instead.")


@torch.inference_mode()
def run_main_model(model: nn.Module, sequence: np.ndarray,
                   capture: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model` over `sequence` at positions 0..T-1 (no cache): its `last_hidden_state` (T, D) and, with `capture`,
    that submodule's output in the same forward (T, ...), taken by a forward hook."""
    seen = []
    hook = capture.register_forward_hook(lambda m, args, out: seen.append(out)) if capture is not None else None
    try:
        ids = torch.from_numpy(np.asarray(sequence, dtype=np.int64))[None]  # (T,) -> (1, T)
        last = model(input_ids=ids, use_cache=False).last_hidden_state[0]
    finally:
        if hook is not None:
            hook.remove()
    if capture is None:
        return last, None
    out = seen[-1][0] if isinstance(seen[-1], tuple) else seen[-1]
    return last, out[0]
