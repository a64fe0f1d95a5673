"""Simulated weight quantization for `mtp-oracle accept --quantize GLOB=SCHEME`: quantize, then dequantize to float32.

What it is: the numbers an engine's dequantizing kernel would multiply with, computed once per tensor, so that the
head runs in float32 on weights that carry exactly the quantization error. What it is not: a quantized kernel (no
integer GEMM, no activation quantization) nor any engine's calibration (no GPTQ/AWQ error feedback, no clipping
search): round-to-nearest with absmax scales, the baseline those methods start from and usually improve on.

Weights are [out, in] (nn.Linear's layout; fused experts are [E, out, in]: leading dims are independent matrices).
Scales are float32 (engines store f32, f16 or bf16 ones: far below the step they scale) and every dequantized
value is one float32 product q * scale. Schemes:

    int8       symmetric per output row: scale = absmax(row) / 127, q = round(w / scale) in [-127, 127]
    int4       symmetric in groups of 32 along the input dim: scale = absmax(group) / 7, q in [-7, 7]
    int4g64    the same with groups of 64; int4g128: 128 (AWQ/GPTQ's default; coarser groups, more error)
    fp8        float8_e4m3fn in 128 x 128 blocks as FP8 MTP checkpoints are released (oracle/fp8.py):
               scale = absmax(block) / 448, q = e4m3(w / scale), round-to-nearest-even by torch's float8 dtype
    int2       ternary: groups of 32, scale = absmax(group), q in {-1, 0, 1} (sub-2-bit formats; harsh on purpose)

Round-to-nearest is ties-to-even throughout (numpy's rint, torch's float8 cast). An all-zero row/group/block gets
scale 0 and dequantizes to zeros. Group 32 is int4's default because it is the finest group engines ship
(llama.cpp's Q4_0 and K-quant sub-blocks; also a common GPTQ/AWQ choice beside 64 and 128), i.e. int4 at its least
harmful; the coarser groups are there to see what they cost. Only the fp8 scheme needs torch (imported there).
"""

import fnmatch
from dataclasses import dataclass

import numpy as np

from oracle.errors import InputError

INT4_GROUP = 32  # the finest group engines ship (llama.cpp Q4_0 / K-quant sub-blocks); see the module docstring
FP8_BLOCK = (128, 128)  # weight_block_size of the FP8 releases oracle/fp8.py reads
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn

INT_SCHEMES = {"int8": (8, None), "int4": (4, INT4_GROUP), "int4g64": (4, 64), "int4g128": (4, 128),
               "int2": (2, INT4_GROUP)}  # bits, group
SCHEMES = {
    "int8": "symmetric int8, one scale per output row",
    "int4": f"symmetric int4, one scale per {INT4_GROUP} inputs",
    "int4g64": "symmetric int4, one scale per 64 inputs",
    "int4g128": "symmetric int4, one scale per 128 inputs",
    "fp8": "float8_e4m3fn, one scale per 128x128 block",
    "int2": f"symmetric ternary (-1, 0, 1), one scale per {INT4_GROUP} inputs",
}


@dataclass(frozen=True)
class QuantSpec:
    """One `--quantize GLOB=SCHEME`: the head tensors whose checkpoint names fnmatch GLOB get SCHEME."""

    glob: str
    scheme: str

    def __str__(self) -> str:
        return f"{self.glob}={self.scheme}"


@dataclass(frozen=True)
class QuantizedTensor:
    name: str
    shape: tuple[int, ...]
    spec: QuantSpec  # the spec that governs it (the last one matching it)
    rel_error: float  # ||Wq - W|| / ||W|| (Frobenius, float64; 0 for an all-zero W)


@dataclass(frozen=True)
class QuantizedHead:
    """What was quantized: the specs in order, each quantized tensor with its error, and the head tensors kept."""

    specs: tuple[QuantSpec, ...]
    tensors: tuple[QuantizedTensor, ...]
    kept: tuple[str, ...]  # head tensors left as stored (1-D, unmatched, FP8 scales, vocabulary copies)


def parse_spec(text: str) -> QuantSpec:
    """`GLOB=SCHEME` -> QuantSpec; InputError naming the option for anything else."""
    glob, sep, scheme = text.rpartition("=")
    if not sep or not glob:
        raise InputError(f"--quantize {text!r}: write GLOB=SCHEME, e.g. --quantize 'mtp.fc.weight=int8' or "
                         f"--quantize '*.mlp.*=int4' (GLOB is matched against the head's checkpoint tensor names; "
                         f"SCHEME is one of {', '.join(SCHEMES)}).")
    if scheme not in SCHEMES:
        raise InputError(f"--quantize {text!r}: unknown scheme {scheme!r}; use one of "
                         f"{'; '.join(f'{k} ({v})' for k, v in SCHEMES.items())}.")
    return QuantSpec(glob, scheme)


def plan(specs: tuple[QuantSpec, ...], shapes: dict[str, tuple[int, ...]],
         not_simulated: dict[str, str]) -> dict[str, QuantSpec]:
    """Head tensor name -> the spec that quantizes it (a later spec wins where two match).

    `shapes` are every head tensor's; `not_simulated` maps names that cannot be quantized here to the reason
    (FP8 scales, tables accept reads itself). A spec that quantizes nothing is refused, naming it."""
    chosen = {}
    for spec in specs:
        matched = [n for n in shapes if fnmatch.fnmatchcase(n, spec.glob)]
        usable = [n for n in matched if len(shapes[n]) >= 2 and n not in not_simulated]
        if not usable:
            raise InputError(_refusal(spec, matched, shapes, not_simulated))
        chosen |= {n: spec for n in usable}
    return dict(sorted(chosen.items()))


def _refusal(spec: QuantSpec, matched: list[str], shapes: dict[str, tuple[int, ...]],
             not_simulated: dict[str, str]) -> str:
    examples = [n for n in shapes if len(shapes[n]) >= 2 and n not in not_simulated][:4]
    hint = (f"Matrix weights of this head include {', '.join(examples)} ({len(shapes)} head tensors in all); "
            f"GLOB is fnmatch on the full checkpoint name, so quote it and use * for any run of characters.")
    if not matched:
        return f"--quantize {spec}: {spec.glob!r} matches no head tensor. {hint}"
    reasons = [f"{n} ({not_simulated[n]})" if n in not_simulated else f"{n} ({len(shapes[n])}-D)"
               for n in matched[:4]]
    more = f" and {len(matched) - 4} more" if len(matched) > 4 else ""
    return (f"--quantize {spec}: {spec.glob!r} matches only tensors this simulation does not quantize: "
            f"{', '.join(reasons)}{more}. Matrix weights (2-D and up) are quantized; 1-D norms and biases, FP8 "
            f"block scales and vocabulary tables are not. {hint}")


def quantize_dequantize(w: np.ndarray, scheme: str) -> np.ndarray:
    """float32 [..., out, in] -> the float32 values the scheme's dequantization gives back."""
    w = np.asarray(w, dtype=np.float32)
    if scheme == "fp8":
        return fp8_blocks(w, FP8_BLOCK)
    bits, group = INT_SCHEMES[scheme]  # a KeyError is a bug: parse_spec refuses unknown schemes first
    return int_groups(w, bits, group or w.shape[-1])


def int_groups(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Symmetric round-to-nearest integer quantization, one float32 scale per `group` consecutive inputs of each
    row (the last group of a row may be shorter): q = rint(w / s) in [-(2^(bits-1) - 1), 2^(bits-1) - 1],
    s = absmax / (2^(bits-1) - 1); returns q * s in float32."""
    qmax = 2 ** (bits - 1) - 1
    rows, width = w.reshape(-1, w.shape[-1]), w.shape[-1]  # (..., out, in) -> (R, in)
    out = np.empty_like(rows)
    for start in range(0, width, group):
        part = rows[:, start:start + group]  # (R, g)
        scale = (np.abs(part).max(axis=1, keepdims=True) / np.float32(qmax)).astype(np.float32)  # (R, 1)
        safe = np.where(scale > 0, scale, np.float32(1))  # an all-zero group: q = 0 whatever the divisor
        q = np.clip(np.rint(part.astype(np.float64) / safe), -qmax, qmax)
        out[:, start:start + group] = q.astype(np.float32) * scale  # one float32 product per element
    return out.reshape(w.shape)


def fp8_blocks(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float8_e4m3fn with one float32 scale per (bo, bi) block of the last two dims (partial blocks at the edges):
    s = absmax / 448, q = e4m3(w / s) by torch's round-to-nearest-even cast; returns e4m3(q) * s in float32."""
    import torch  # only this scheme needs it; the CLI checks its arguments before torch is loaded

    mats = w.reshape(-1, *w.shape[-2:])  # (..., out, in) -> (M, out, in)
    out = np.empty_like(mats)
    bo, bi = block
    for r in range(0, mats.shape[1], bo):
        for c in range(0, mats.shape[2], bi):
            part = mats[:, r:r + bo, c:c + bi]  # (M, <=bo, <=bi)
            scale = (np.abs(part).max(axis=(1, 2), keepdims=True) / np.float32(E4M3_MAX)).astype(np.float32)
            safe = np.where(scale > 0, scale, np.float32(1))
            # clamp: a float32 scale rounded down can put |w/s| a hair past 448, which the cast would make NaN
            scaled = np.clip(part / safe, -E4M3_MAX, E4M3_MAX)
            q = torch.from_numpy(np.ascontiguousarray(scaled)).to(torch.float8_e4m3fn).to(torch.float32).numpy()
            out[:, r:r + bo, c:c + bi] = q * scale
    return out.reshape(w.shape)


def relative_error(w: np.ndarray, wq: np.ndarray) -> float:
    """||wq - w|| / ||w|| in float64 (Frobenius); 0 when both are all zero."""
    w64 = np.asarray(w, dtype=np.float64)
    norm = float(np.linalg.norm(w64))
    diff = float(np.linalg.norm(np.asarray(wq, dtype=np.float64) - w64))
    return diff / norm if norm else diff


def quantize_tensor(name: str, w: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, QuantizedTensor]:
    """One head tensor quantized per `spec`: its dequantized float32 values and what that cost."""
    if not np.isfinite(w).all():
        raise InputError(f"--quantize {spec}: head tensor {name} has non-finite values (NaN/Inf) in the "
                         f"checkpoint, so it has no absmax to scale by; fix the checkpoint or leave it out of GLOB.")
    wq = quantize_dequantize(w, spec.scheme)
    return wq, QuantizedTensor(name, tuple(w.shape), spec, relative_error(w, wq))
