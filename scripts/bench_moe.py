"""MoE export at Qwen3-Next-80B-A3B scale against this machine's own floor, measured side by side in one run.

    python scripts/bench_moe.py [--checkpoint DIR] [--work DIR]     (also: python scripts/bench.py --only moe)

The workload is a synthetic Qwen3-Next-shaped MTP layer (scripts/make_realscale_moe_checkpoint.py: hidden 2048,
16/2 heads of 256, 512 experts top-10, moe_intermediate 512, shared 512, vocab 151936; ~3.3 GB of bf16 experts).
For T = 16 and 512 it reports the experts read, the bytes read, the export time against its floor
(bytes read / sequential read rate + FLOPs / GEMM rate, both measured in this run on this machine, the GEMMs at the
trace's own routing), and the peak RSS against (non-expert head + experts touched) in float32.
Goals (issue 11): time <= 1.5x the floor; peak RSS <= 1.5x that float32 size.

    python scripts/bench_moe.py --family deepseek_v3 [--checkpoint DIR] [--experts N] [--threads N]

The DeepSeek-V3-shaped MTP layer (issue 12; scripts/make_realscale_deepseek_checkpoint.py: hidden 7168, MLA 128
heads, 256 FP8 experts top-8 in 8 groups keeping 4, ~11.7 GB FP8 with 128x128 block scales). Export at T = 32 and
169 and `accept` with k=2 over 169 positions: the time against the floor (bytes read / read rate + FLOPs / GEMM
rate, both measured in this run: GEMMs in float32 at the trace's own routing), the experts read and the peak RSS.
Goals: time <= 1.5x the floor, peak RSS <= 6 GB. `--threads N` sets OMP_NUM_THREADS for every child (floors
included): on a shared, oversubscribed machine torch's 2-thread kernels wait on each other (index_add_ on a
[32, 7168] tensor: 4 ms with 2 threads under load, 0.05 ms with 1).

    python scripts/bench_moe.py --dequant [--repeats N]

The FP8 block dequant alone (oracle/fp8.py), in ns per element: the numpy specification and the compiled kernel
(oracle/_fp8dequant.c) on the same DeepSeek-V3 expert matrices (gate/up 2048 x 7168, down 7168 x 2048, 128 x 128
blocks) into the same reused float32 buffer, alternated, best of N; their outputs are checked bit-equal.

    python scripts/bench_moe.py --fp8-linear [--threads N]

The head's dense FP8 linears (Fp8Linear: a block of rows dequantized at a time into a reused buffer) at
DeepSeek-V3's shapes, against the whole-weight dequant into a fresh array they replaced: bit-equal outputs at
T = 1, 32, 169, and the times at T = 1 (the first, with its page faults, and a later call).
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


# ---- DeepSeek-V3 (FP8, MLA, grouped router) -------------------------------------------------------------------

DS_VOCAB, DS_TARGET_RSS_GB = 129280, 6.0


def _ds_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, DS_VOCAB, n)


ROUTED: dict[int, int] = {}  # expert -> (token, expert) pairs routed to it in this process, over every forward


def _record_routing() -> None:
    """Count what the official experts forward is handed (its top_k_index), through RoutedExperts' pre-hook."""
    from oracle.families import moe_experts

    hook = moe_experts.RoutedExperts._routed

    def counting(self, module, args):
        for e, n in zip(*np.unique(args[1].numpy(), return_counts=True)):
            ROUTED[int(e)] = ROUTED.get(int(e), 0) + int(n)
        return hook(self, module, args)

    moe_experts.RoutedExperts._routed = counting


def child_ds_export(ckpt: str, t: int, out: str) -> None:
    from oracle.export import HiddenSource, export_trace
    from oracle.families import deepseek_v3  # noqa: F401  (imports done before the clock starts)

    _record_routing()
    start = time.perf_counter()
    export_trace(Path(ckpt), Path(out), _ds_ids(t, t), HiddenSource(seed=0))
    print(json.dumps({"s": time.perf_counter() - start, "routing": ROUTED}))


def child_ds_accept(ckpt: str, chains: int, k: int) -> None:
    from oracle.accept import measure_acceptance
    from oracle.export import HiddenSource
    from oracle.families import deepseek_v3  # noqa: F401

    _record_routing()
    start = time.perf_counter()
    measure_acceptance(Path(ckpt), _ds_ids(chains + 1 + k, 7), HiddenSource(seed=0), k=k, target="text")
    print(json.dumps({"s": time.perf_counter() - start, "routing": ROUTED}))


def _gemm_s(shapes: list[tuple[int, int, int]], cache: dict) -> float:
    """float32 F.linear time (best of 3) summed over (rows, out, in); shapes over 64M weight elements are timed on
    a slice of 8192 output rows and scaled (compute-bound at these row counts)."""
    import torch

    total = 0.0
    for rows, o, n in shapes:
        if rows == 0:
            continue
        part = min(o, 8192) if o * n > (1 << 26) else o
        key = (rows, part, n)
        if key not in cache:
            w, x = torch.randn(part, n), torch.randn(rows, n)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - start)
            cache[key] = min(times)
        total += cache[key] * o / part
    return total


def child_ds_floors(ckpt: str, experts_json: str, rows: int, lm_rows: int) -> None:
    """Read rate (GB/s, warm, reused buffer, an expert shard) and the float32 GEMM time of the head's linears at
    `rows` tokens with the routing given (expert -> tokens routed to it), plus lm_head at `lm_rows` (accept)."""
    from oracle.checkpoint import Checkpoint

    c = Checkpoint(Path(ckpt))
    layout, cfg = c.layout(), c.config
    counts = {int(e): int(n) for e, n in json.loads(experts_json).items()}
    names = layout.experts.tensor_names()
    shard = c.entry(names[-1]).file
    buf = bytearray(1 << 30)
    best = float("inf")
    for _ in range(3):
        with open(shard, "rb", buffering=0) as f:
            start = time.perf_counter()
            got = f.readinto(buf)
            best = min(best, time.perf_counter() - start)
    read_gbps = got / best / 1e9
    d, h, i = cfg.hidden_size, cfg.num_attention_heads, cfg.moe_intermediate_size
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    dense = [(d, 2 * d), (cfg.q_lora_rank, d), (h * qk, cfg.q_lora_rank), (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d),
             (h * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank), (d, h * v), (cfg.num_experts, d),
             (2 * i * cfg.n_shared_experts, d), (d, i * cfg.n_shared_experts)]
    shapes = [(rows, o, n) for o, n in dense]
    shapes += [(n, o_, i_) for n in counts.values() for o_, i_ in ((2 * i, d), (d, i))]
    if lm_rows:
        shapes.append((lm_rows, cfg.vocab_size, d))
    flops = sum(2.0 * r * o * n for r, o, n in shapes) + 2.0 * h * (qk + v) * rows * (rows + 1) / 2
    gemm_s = _gemm_s(shapes, {})
    per_expert = sum(c.entry(n).nbytes for n in names) / cfg.num_experts
    dense_bytes = sum(c.entry(n).nbytes for n in layout.dense)  # FP8 scales included, the experts' too (small)
    lm_bytes = c.entry("lm_head.weight").nbytes if lm_rows else 0
    bytes_read = dense_bytes + len(counts) * per_expert + rows * d * 2 + lm_bytes
    print(json.dumps({"read_gbps": read_gbps, "gemm_s": gemm_s, "gflop": flops / 1e9, "bytes_read": bytes_read}))


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def bench_deepseek(ckpt: Path, work: Path, rows: list, experts: int = 256) -> None:
    if not (ckpt / "model.safetensors.index.json").is_file():
        subprocess.run([PY, str(ROOT / "scripts" / "make_realscale_deepseek_checkpoint.py"), str(ckpt),
                        "--experts", str(experts)], check=True)
    total = json.loads((ckpt / "config.json").read_text())["n_routed_experts"]
    from oracle.fp8 import kernel_note
    rows.append(("DeepSeek-V3 FP8 dequant path", "compiled kernel" if kernel_note() is None else "numpy (kernel "
                 "not built: the figures below are the fallback's)", "", "", ""))
    work.mkdir(parents=True, exist_ok=True)
    for t in (32, 169):
        trace = work / f"ds{t}.h5"
        runs = [run_child(["child-ds-export", str(ckpt), str(t), str(trace)]) for _ in range(2)]
        inner = [_last_json(out) for _, _, out in runs]
        export_s, rss = min(r["s"] for r in inner), max(r for _, r, _ in runs)
        routing = inner[0]["routing"]
        floors = _last_json(run_child(["child-ds-floors", str(ckpt), json.dumps(routing), str(t), "0"])[2])
        floor = floors["bytes_read"] / floors["read_gbps"] / 1e9 + floors["gemm_s"]
        rows.append((f"DeepSeek-V3 FP8 export T={t}: {len(routing)} of {total} experts read, "
                     f"{floors['bytes_read'] / 1e9:.2f} GB", f"{export_s:.2f} s",
                     f"floor {floor:.2f} s (read {floors['read_gbps']:.1f} GB/s, GEMM {floors['gemm_s']:.2f} s "
                     f"for {floors['gflop']:.0f} GFLOP)", f"{export_s / floor:.2f}x", f"<= {TARGET_TIME}x"))
        rows.append((f"DeepSeek-V3 FP8 export T={t}: peak RSS (worst of 2)", f"{rss:.2f} GB", "", "",
                     f"<= {DS_TARGET_RSS_GB:.0f} GB"))
    chains, k = 169, 2
    runs = [run_child(["child-ds-accept", str(ckpt), str(chains), str(k)]) for _ in range(2)]
    inner = [_last_json(out) for _, _, out in runs]
    accept_s, rss = min(r["s"] for r in inner), max(r for _, r, _ in runs)
    touched = routing = inner[0]["routing"]  # every forward's routing (the bridge pass and the draft steps)
    head_rows = sum(routing.values()) // 8  # token rows through the head
    floors = _last_json(run_child(["child-ds-floors", str(ckpt), json.dumps(routing), str(head_rows),
                                   str(chains * k)])[2])
    floor = floors["bytes_read"] / floors["read_gbps"] / 1e9 + floors["gemm_s"]
    rows.append((f"DeepSeek-V3 FP8 accept k={k}, {chains} positions: {len(touched)} of {total} experts read",
                 f"{accept_s:.2f} s", f"floor {floor:.2f} s (read {floors['read_gbps']:.1f} GB/s, GEMM "
                 f"{floors['gemm_s']:.2f} s for {floors['gflop']:.0f} GFLOP incl. lm_head)", f"{accept_s / floor:.2f}x",
                 f"<= {TARGET_TIME}x"))
    rows.append((f"DeepSeek-V3 FP8 accept: peak RSS (worst of 2)", f"{rss:.2f} GB", "", "",
                 f"<= {DS_TARGET_RSS_GB:.0f} GB"))


def bench_dequant(rows: list, repeats: int) -> None:
    from oracle import fp8

    block = (128, 128)
    rng = np.random.default_rng(0)
    for shape in ((2048, 7168), (7168, 2048)):
        bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
        scales = rng.uniform(1e-4, 1e-2, size=fp8.scale_shape(shape, block)).astype(np.float32)
        outs = {"numpy": np.empty(shape, dtype=np.float32), "kernel": np.empty(shape, dtype=np.float32)}
        paths = {"numpy": lambda out: fp8.dequantize_numpy(bits, scales, block, out),
                 "kernel": lambda out: fp8.dequantize(bits, scales, block, out=out)}
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(repeats):  # alternated: load on a shared machine hits both alike
            for name, run in paths.items():
                start = time.perf_counter()
                run(outs[name])
                best[name] = min(best[name], time.perf_counter() - start)
        same = np.array_equal(outs["numpy"].view(np.uint32), outs["kernel"].view(np.uint32))
        ns = {name: s / bits.size * 1e9 for name, s in best.items()}
        kernel = "kernel" if fp8.kernel_note() is None else "kernel NOT BUILT (numpy ran)"
        rows.append((f"FP8 dequant {shape[0]}x{shape[1]}, 128x128 blocks (best of {repeats})",
                     f"numpy {ns['numpy']:.3f} ns/el", f"{kernel} {ns['kernel']:.3f} ns/el",
                     f"{ns['numpy'] / ns['kernel']:.1f}x faster", "bit-equal" if same else "OUTPUTS DIFFER"))


# DeepSeek-V3's dense FP8 linears (the MTP layer's attention projections and its shared expert), [out, in]
DS_DENSE_FP8 = {"q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536), "kv_a_proj_with_mqa": (576, 7168),
                "kv_b_proj": (32768, 512), "o_proj": (7168, 16384), "shared_experts.gate_proj": (2048, 7168),
                "shared_experts.down_proj": (7168, 2048)}


def bench_fp8_linear(rows: list, tokens: tuple[int, ...] = (1, 32, 169)) -> None:
    """Fp8Linear (oracle/families/mtp_layer.py) at DeepSeek-V3's dense FP8 shapes on random e4m3 bytes and 128x128
    scales: its output against the path it replaced (the whole weight dequantized into a fresh float32 array, then
    F.linear), bit for bit at each T, and both times at the first T (Fp8Linear's first call pays its buffer's page
    faults once; later calls reuse it)."""
    import torch
    import torch.nn.functional as F

    from oracle import fp8
    from oracle.families.torch_parts import Fp8Linear

    block, rng = (128, 128), np.random.default_rng(0)
    for name, shape in DS_DENSE_FP8.items():
        bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x38  # no NaN patterns (NaN != NaN)
        scales = rng.uniform(1e-4, 1e-2, size=fp8.scale_shape(shape, block)).astype(np.float32)
        linear = Fp8Linear(torch.from_numpy(bits), torch.from_numpy(scales), block, name=name)
        same, times = True, {}
        for t in tokens:
            x = torch.randn(1, t, shape[1])
            start = time.perf_counter()
            whole = F.linear(x, torch.from_numpy(fp8.dequantize(bits, scales, block)))
            times.setdefault("whole", time.perf_counter() - start)
            for call in ("first", "again"):
                start = time.perf_counter()
                got = linear(x)
                times.setdefault(call, time.perf_counter() - start)
                same &= torch.equal(got, whole)
        rows.append((f"FP8 linear {name} {shape[0]}x{shape[1]}, T={tokens[0]}",
                     f"whole dequant + linear {times['whole'] * 1e3:.0f} ms",
                     f"Fp8Linear {times['first'] * 1e3:.0f} ms (first call), {times['again'] * 1e3:.0f} ms (again)",
                     f"{len(linear.chunks)} chunks", f"bit-equal at T={','.join(map(str, tokens))}" if same
                     else "OUTPUTS DIFFER"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen3_next", "deepseek_v3"), default="qwen3_next")
    parser.add_argument("--checkpoint", type=Path, help="default /tmp/mtp-bench/q3next or /tmp/mtp-bench/dsv3")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mtp-bench/work-moe"))
    parser.add_argument("--experts", type=int, default=256, help="deepseek_v3: routed experts when generating")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every child (default: torch's own)")
    parser.add_argument("--dequant", action="store_true", help="only the FP8 dequant: numpy vs compiled kernel")
    parser.add_argument("--repeats", type=int, default=5, help="--dequant: best of this many (default 5)")
    parser.add_argument("--fp8-linear", action="store_true", help="only Fp8Linear vs the whole dequant at "
                        "DeepSeek-V3's dense FP8 shapes: bit-equality and times")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    rows: list = []
    if args.dequant:
        bench_dequant(rows, args.repeats)
    elif args.fp8_linear:
        bench_fp8_linear(rows)
    elif args.family == "deepseek_v3":
        bench_deepseek(args.checkpoint or Path("/tmp/mtp-bench/dsv3"), args.work, rows, args.experts)
    else:
        bench_moe(args.checkpoint or Path("/tmp/mtp-bench/q3next"), args.work, rows)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print(" | ".join(cell.ljust(w) for cell, w in zip(r, widths)))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("child-"):
        {"child-export": lambda a: child_export(a[0], int(a[1]), a[2]),
         "child-floors": lambda a: child_floors(a[0], a[1]),
         "child-ds-export": lambda a: child_ds_export(a[0], int(a[1]), a[2]),
         "child-ds-accept": lambda a: child_ds_accept(a[0], int(a[1]), int(a[2])),
         "child-ds-floors": lambda a: child_ds_floors(a[0], a[1], int(a[2]), int(a[3]))}[sys.argv[1]](sys.argv[2:])
    else:
        main()
