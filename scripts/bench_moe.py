"""MoE export at Qwen3-Next-80B-A3B scale against this machine's own floor, measured side by side in one run.

    python scripts/bench_moe.py [--checkpoint DIR] [--work DIR]     (also: python scripts/bench.py --only moe)

The workload is a synthetic Qwen3-Next-shaped MTP layer (scripts/make_realscale_moe_checkpoint.py: hidden 2048,
16/2 heads of 256, 512 experts top-10, moe_intermediate 512, shared 512, vocab 151936; ~3.3 GB of bf16 experts).
For T = 16 and 512 it reports the experts read, the bytes read, the export time against its floor
(bytes read / sequential read rate + FLOPs / GEMM rate, both measured in this run on this machine, the GEMMs at the
trace's own routing), and the peak RSS against (non-expert head + experts touched) in float32.
Goals (issue 11): time <= 1.5x the floor; peak RSS <= 1.5x that float32 size.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TARGET_TIME, TARGET_RSS = 1.5, 1.5


def child_export(ckpt: str, t: int, out: str) -> None:
    """The export in its own process: its time (imports excluded) and what it read."""
    from oracle.checkpoint import Checkpoint
    from oracle.export import HiddenSource, export_trace
    from oracle.families.registry import head_module

    head_module(Checkpoint(Path(ckpt)).family)  # export_trace would import torch and transformers itself
    ids = np.random.default_rng(t).integers(0, 151936, t)
    start = time.perf_counter()
    export_trace(Path(ckpt), Path(out), ids, HiddenSource(seed=0))
    print(json.dumps({"export_s": time.perf_counter() - start}))


def child_floors(ckpt: str, trace: str) -> None:
    """Read rate (GB/s, warm, reused buffer) and the time of the trace's own GEMMs in float32 (best of 3)."""
    import torch

    from oracle.checkpoint import Checkpoint
    from oracle.trace import read_trace

    ckpt_ = Checkpoint(Path(ckpt))
    layout = ckpt_.layout()
    shard = ckpt_.entry(sorted(layout.experts.tensor_names())[0]).file
    buf = bytearray(1 << 30)
    best = float("inf")
    for _ in range(3):
        with open(shard, "rb", buffering=0) as f:
            start = time.perf_counter()
            got = f.readinto(buf)
            best = min(best, time.perf_counter() - start)
    read_gbps = got / best / 1e9
    with read_trace(Path(trace)) as reader:
        ids = reader.stage_rows("topk_ids")
    t = len(ids)
    cfg = ckpt_.config
    d, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv, i, s = cfg.num_key_value_heads * cfg.head_dim, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    dense = [(d, 2 * d), (2 * q, d), (kv, d), (kv, d), (d, q), (cfg.num_experts, d), (s, d), (s, d), (d, s), (1, d)]
    counts = np.bincount(ids.ravel(), minlength=cfg.num_experts)
    shapes = [(rows, o, n) for rows, (o, n) in ((t, sh) for sh in dense)]
    shapes += [(int(c), o, n) for c in counts[counts > 0] for (o, n) in ((2 * i, d), (d, i))]
    flops = sum(2.0 * r * o * n for r, o, n in shapes) + 2.0 * 2 * cfg.num_attention_heads * cfg.head_dim * t * (t + 1) / 2
    gemm_s = 0.0
    cache = {}
    for rows, o, n in shapes:
        key = (rows, o, n)
        if key not in cache:
            w, x = torch.randn(o, n), torch.randn(rows, n)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - start)
            cache[key] = min(times)
        gemm_s += cache[key]
    touched = int((counts > 0).sum())
    expert_bytes = sum(ckpt_.entry(n).nbytes for n in layout.experts.tensor_names()) / cfg.num_experts
    dense_bytes = sum(ckpt_.entry(n).nbytes for n in layout.dense)
    bytes_read = dense_bytes + touched * expert_bytes + t * d * 2
    f32 = 2 * (dense_bytes + touched * expert_bytes)
    print(json.dumps({"read_gbps": read_gbps, "gemm_s": gemm_s, "flops": flops, "touched": touched,
                      "bytes_read": bytes_read, "f32_bytes": f32}))


def run_child(args: list[str]) -> tuple[float, float, str]:
    start = time.perf_counter()
    proc = subprocess.Popen([PY, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{args} failed:\n{err[-3000:]}")
    return time.perf_counter() - start, usage.ru_maxrss / 1e6, out


def bench_moe(ckpt: Path, work: Path, rows: list) -> None:
    if not (ckpt / "model.safetensors.index.json").is_file():
        subprocess.run([PY, str(ROOT / "scripts" / "make_realscale_moe_checkpoint.py"), str(ckpt)], check=True)
    work.mkdir(parents=True, exist_ok=True)
    for t in (16, 512):
        trace = work / f"moe{t}.h5"
        runs = [run_child(["child-export", str(ckpt), str(t), str(trace)]) for _ in range(2)]
        export_s = min(json.loads(out)["export_s"] for _, _, out in runs)
        rss = min(r for _, r, _ in runs)
        floors = json.loads(run_child(["child-floors", str(ckpt), str(trace)])[2])
        floor = floors["bytes_read"] / floors["read_gbps"] / 1e9 + floors["gemm_s"]
        rows.append((f"MoE export T={t}: {floors['touched']} of 512 experts read, "
                     f"{floors['bytes_read'] / 1e9:.2f} GB", f"{export_s:.2f} s",
                     f"floor {floor:.2f} s (read {floors['read_gbps']:.1f} GB/s, GEMM {floors['gemm_s']:.2f} s)",
                     f"{export_s / floor:.2f}x", f"<= {TARGET_TIME}x"))
        rows.append((f"MoE export T={t}: peak RSS", f"{rss:.2f} GB",
                     f"head + touched experts f32 {floors['f32_bytes'] / 1e9:.2f} GB",
                     f"{rss / (floors['f32_bytes'] / 1e9):.2f}x", f"<= {TARGET_RSS}x"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/mtp-bench/q3next"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/mtp-bench/work-moe"))
    args = parser.parse_args()
    rows: list = []
    bench_moe(args.checkpoint, args.work, rows)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print(" | ".join(cell.ljust(w) for cell, w in zip(r, widths)))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("child-"):
        {"child-export": lambda a: child_export(a[0], int(a[1]), a[2]),
         "child-floors": lambda a: child_floors(a[0], a[1])}[sys.argv[1]](sys.argv[2:])
    else:
        main()
