"""`mtp-probe weights CKPT DUMP`: the load audit. Did the engine hold the head's weights the checkpoint holds?

DUMP is what the engine holds after loading: one `.safetensors` file, or a directory of `.safetensors` and `.npy`
files (an `.npy` file's name, less `.npy`, is the tensor's name). Names are the checkpoint's (`mtp.fc.weight`), or
the engine's fused names where the family declares the fusion (`FamilySpec.fusions`: vLLM's `qkv_proj`,
`gate_up_proj`, FusedMoE `experts.w13_weight`/`w2_weight`). Every head tensor (`Checkpoint.layout().shapes()`, read
dequantized: FP8 block scales applied, GGUF dequantized) is classified by probe/weight_faults.py. Dump tensors
that are not head tensors are ignored and listed. Torch-free: safetensors are read with the oracle's own header
parser (bf16 included), `.npy` with numpy.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.checkpoint import Checkpoint, _read_safetensors_header, _widen
from oracle.errors import CheckpointError, InputError
from oracle.inputs import npy_claims
from oracle.reading import check_regular_file
from oracle.output import atomic_output

from probe.weight_faults import Finding, TensorFacts, classify, halves_permutation, init_stds

SCHEMA = "mtp-probe-weights/1"
_DUMP_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8"}


@dataclass(frozen=True)
class TensorAudit:
    name: str  # the checkpoint's name, or the engine's fused name
    status: str
    max_rel: float | None
    note: str
    shape: tuple[int, ...]  # the checkpoint's (fused: assembled) shape


@dataclass
class WeightsReport:
    checkpoint: str
    dump: str
    family: str
    tensors: list[TensorAudit]
    ignored: list[str] = field(default_factory=list)  # dump tensors that are not head tensors

    @property
    def bad(self) -> list[TensorAudit]:
        return [t for t in self.tensors if t.status != "ok"]

    @property
    def verdict(self) -> str:
        return "differ" if self.bad else "ok"

    @property
    def exit_code(self) -> int:
        return 1 if self.bad else 0

    def summary_line(self) -> str:
        n = len(self.tensors)
        if not self.bad:
            return f"WEIGHTS OK | {n} of {n} tensors match the checkpoint | family={self.family}"
        listed = ", ".join(f"{t.name} ({t.status})" for t in self.bad[:8])
        more = f", … {len(self.bad) - 8} more" if len(self.bad) > 8 else ""
        return f"WEIGHTS DIFFER | {len(self.bad)} of {n} tensors: {listed}{more}"

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "verdict": self.verdict, "checkpoint": self.checkpoint, "dump": self.dump,
                "family": self.family, "ignored": self.ignored,
                "tensors": [{"name": t.name, "status": t.status, "max_rel": t.max_rel, "note": t.note,
                             "shape": list(t.shape)} for t in self.tensors]}


def audit_weights(checkpoint: Path, dump: Path) -> WeightsReport:
    """Classify every head tensor of `checkpoint` as the engine's `dump` holds it (see the module docstring)."""
    ckpt = Checkpoint(checkpoint)
    _refuse_the_checkpoint_itself(ckpt, Path(dump))
    layout = ckpt.layout()
    reference = ckpt.read_head(widen=True, digest=False).tensors
    held = read_dump(Path(dump))
    declared = getattr(ckpt.family, "fusions", None)  # FamilySpec.fusions (optional)
    fusions = declared(ckpt.config, layout) if declared else {}
    rows, covered = [], set()
    for fused, fusion in fusions.items():
        if fused in held:
            parts = _parts(fusion)
            ref = _assemble(fusion, reference)
            rows.append(_audit(fused, held[fused], ref, ckpt, f"fused {' + '.join(_short(p) for p in parts)}: "))
            covered |= set(_expand(fusion))
    scales = _block_scales(layout.shapes())
    for name in sorted(layout.shapes()):
        if name in held:
            rows.append(_audit(name, held[name], reference[name], ckpt, ""))
        elif name not in covered and name not in scales:
            rows.append(TensorAudit(name, "missing", None, "not in the dump" + _fused_hint(name, fusions),
                                    tuple(reference[name].shape)))
    known = set(layout.shapes()) | set(fusions)
    if not any(name in held for name in known):
        raise InputError(f"none of the {len(held)} tensors in {dump} is a head tensor of the {ckpt.family.name} "
                         f"checkpoint {checkpoint} (it has {_examples(held)}; the head's are e.g. "
                         f"{_examples(layout.shapes())}). Dump with the checkpoint's names or the family's fused "
                         f"names ({', '.join(_short(f) for f in fusions) or 'none declared'}).")
    return WeightsReport(str(checkpoint), str(dump), ckpt.family.name, rows, sorted(set(held) - known))


def _block_scales(names) -> set[str]:
    """FP8 block scales (`X.weight_scale_inv`, DeepSeek-V4's `X.scale`) beside a head weight: a dequantized dump has
    no reason to hold them, and its weight is audited against the checkpoint's dequantized value, scale applied.
    Audited only where the dump holds them."""
    names = set(names)
    return {n for n in names if (n.endswith(".weight_scale_inv") and n.removesuffix("_scale_inv") in names)
            or (n.endswith(".scale") and n.removesuffix("scale") + "weight" in names)}


def _audit(name: str, held, ref: np.ndarray, ckpt: Checkpoint, prefix: str) -> TensorAudit:
    array = held()
    if array.shape != ref.shape and not (array.ndim >= 2 and array.shape == ref.shape[:-2] + ref.shape[:-3:-1]):
        raise InputError(f"dump tensor {name} has shape {list(array.shape)}; the checkpoint's is {list(ref.shape)} "
                         f"(or its transpose). Its shape matches nothing: is the dump from another model or config?")
    finding: Finding = classify(array, ref, _facts(name, ref, ckpt))
    return TensorAudit(name, finding.status, finding.max_rel, prefix + finding.note, tuple(ref.shape))


def _facts(name: str, ref: np.ndarray, ckpt: Checkpoint) -> TensorFacts:
    cfg = ckpt.config
    halves = None
    if name.endswith(("q_proj.weight", "qkv_proj.weight")) and hasattr(cfg, "head_dim"):
        halves = halves_permutation(cfg.num_attention_heads, cfg.head_dim)
    stds = init_stds(ref.shape, _initializer_range(ckpt)) if ref.ndim >= 2 else {}
    module = name.rsplit(".", 2)
    is_norm = ref.ndim == 1 and len(module) == 3 and module[2] == "weight" and "norm" in module[1]
    norm = ("1+w" if ckpt.family.one_plus_norms else "w") if is_norm else None
    return TensorFacts(name, stds, halves, norm)


def _initializer_range(ckpt: Checkpoint) -> float:
    """config.json's initializer_range (transformers' default 0.02 when absent): a positive finite number."""
    text = ckpt.raw_config.get("text_config", ckpt.raw_config)
    value = text.get("initializer_range", 0.02) if isinstance(text, dict) else 0.02
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise CheckpointError(f"{ckpt.path / 'config.json'}: initializer_range is {value!r:.60}; it is the std of "
                              f"the weights' initialisation, a positive number (e.g. 0.02).")
    return float(value)


def _parts(fusion) -> tuple[str, ...]:
    return tuple(p.replace(".{e}", "") for p in fusion.parts)


def _expand(fusion) -> list[str]:
    if not fusion.experts:
        return list(fusion.parts)
    return [p.format(e=e) for e in range(fusion.experts) for p in fusion.parts]


def _assemble(fusion, reference: dict[str, np.ndarray]) -> np.ndarray:
    if not fusion.experts:
        return np.concatenate([reference[p] for p in fusion.parts], axis=fusion.axis)
    return np.stack([np.concatenate([reference[p.format(e=e)] for p in fusion.parts], axis=fusion.axis)
                     for e in range(fusion.experts)])  # E x (sum of parts' rows, cols)


def _fused_hint(name: str, fusions: dict) -> str:
    into = [f for f, fusion in fusions.items() if name in _expand(fusion)]
    return f" (nor its fused form {', '.join(into)})" if into else ""


def _short(name: str) -> str:
    return name.removeprefix("mtp.layers.0.").removesuffix(".weight")


def _examples(names) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")


def _refuse_the_checkpoint_itself(ckpt: Checkpoint, dump: Path) -> None:
    """A dump that is (or holds) one of the checkpoint's own safetensors files (the same file, the same folder, a
    symlink or hard link to it) would compare the checkpoint with itself: WEIGHTS OK, having checked nothing."""
    dump_files = [dump] if dump.is_file() else sorted(dump.glob("*.safetensors"))
    own = sorted(ckpt.path.glob("*.safetensors"))
    for file in dump_files:
        same = next((shard for shard in own if _same_file(file, shard)), None)
        if same is not None:
            raise InputError(f"the dump is the checkpoint itself ({file} is the checkpoint's {same.name}): dump "
                             f"what your engine holds after loading (its parameters, e.g. safetensors.torch."
                             f"save_file of the module's state_dict) and pass that file or folder as DUMP.")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def read_dump(path: Path) -> dict:
    """Tensor name -> a function returning the dump's array (float32/float64), read only when called."""
    if not path.is_dir():
        check_regular_file(path, "weights dump")  # a FIFO or a device: refused, never opened
        if path.suffix != ".safetensors":
            raise InputError(f"{path}: a dump is a .safetensors file or a directory of .safetensors / .npy files.")
        return _safetensors_tensors(path)
    tensors, origin = {}, {}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".npy") and p.is_file())
    if not files:
        raise InputError(f"{path} holds no .safetensors or .npy files; dump the engine's loaded weights there.")
    for file in files:
        found = _safetensors_tensors(file) if file.suffix == ".safetensors" else {file.stem: _npy_loader(file)}
        for name, loader in found.items():
            if name in tensors:
                raise InputError(f"dump tensor {name} is in both {origin[name].name} and {file.name}; keep one.")
            tensors[name], origin[name] = loader, file
    return tensors


def _safetensors_tensors(file: Path) -> dict:
    entries = _read_safetensors_header(file)  # CheckpointError naming the file when it is not safetensors
    for entry in entries.values():
        if entry.dtype not in _DUMP_DTYPES:
            raise InputError(f"dump tensor {entry.name} in {file.name} is {entry.dtype}; the audit compares values: "
                             f"dump it dequantized as {', '.join(_DUMP_DTYPES)}.")

    def loader(entry):
        def load() -> np.ndarray:
            count = int(np.prod(entry.shape))
            try:  # read, never mapped: a file cut short meanwhile is a short read here, not a SIGBUS later
                stored = np.fromfile(entry.file, dtype=_DUMP_DTYPES[entry.dtype], count=count, offset=entry.offset)
            except OSError as err:
                raise InputError(f"dump tensor {entry.name}: reading {entry.file} failed ({err.strerror or err}).") \
                    from None
            if stored.size != count:
                raise InputError(f"dump tensor {entry.name}: {entry.file} ended inside it (cut short, maybe while "
                                 f"being read); dump the weights again.")
            stored = stored.reshape(entry.shape)
            return stored if entry.dtype == "F64" else _widen(stored, entry.dtype)
        return load

    return {name: loader(entry) for name, entry in entries.items()}


def _npy_loader(file: Path):
    def load() -> np.ndarray:
        npy_claims(file)  # a regular .npy file (not a FIFO, not a .npz saved as .npy) holding what it claims
        try:
            # read whole, never mapped: a mapped page past the end of a file cut short meanwhile was a SIGBUS
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise InputError(f"dump tensor {file.stem}: {file} is not a readable .npy file ({err}).") from None
        if array.dtype.kind != "f":
            raise InputError(f"dump tensor {file.stem} in {file.name} is {array.dtype}; the audit compares values: "
                             f"save it dequantized as float16, float32 or float64.")
        return np.asarray(array, dtype=np.float64 if array.dtype == np.float64 else np.float32)
    return load


def render_weights(report: WeightsReport, verbose: bool = False) -> str:
    lines = [f"load audit: {report.dump} against {report.checkpoint} (family {report.family})"]
    for t in report.tensors:
        if verbose or t.status != "ok":
            rel = "-" if t.max_rel is None else f"{t.max_rel:.3g}"
            # transposed: the figure is of the tensor transposed back; "max_rel 0" alone read like a match
            rel += " once transposed back (wrong as stored)" if t.status == "transposed" else ""
            lines.append(f"  {t.status:<14} {t.name}  max_rel {rel}  {t.note}")
    ok = len(report.tensors) - len(report.bad)
    lines.append(f"  {ok} ok" + ("" if verbose or not ok else " (-v lists them)"))
    if report.ignored:
        lines.append(f"  ignored {len(report.ignored)} dump tensors that are not head tensors: "
                     f"{_examples(report.ignored)}")
    return "\n".join(lines)


def write_weights_json(payload: dict, path: Path) -> None:
    with atomic_output(path) as tmp:
        Path(tmp).write_text(json.dumps(payload, indent=2) + "\n")
