"""`--explain` speed at real scale: the Qwen3.5-27B-shaped head at T=169, against the plain export.

    python scripts/bench_explain.py [--checkpoint DIR] [--work DIR] [--variant rope_interleaved] [--t 169]

Generates the 27B-shaped checkpoint (scripts/make_realscale_checkpoint.py) if DIR lacks one, exports a reference
(`mtp-oracle export`, timed), writes a candidate trace that is the oracle with one wiring variant applied (default
rope_interleaved: it diverges only at attn@1, so every attention variant runs up to attn and the matching one runs
all the way: the slow case), then times `mtp-probe diff REF CAND` with and without `--explain`. Each command is a
child process measured with wait4 (wall time, peak RSS). Goal (issue 14): the explain part within 3x the export.
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
BIN = Path(PY).parent


def timed(cmd: list) -> tuple[float, float, str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) not in (0, 1, 3):
        raise RuntimeError(f"{cmd} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss / 1e6, out, usage.ru_utime + usage.ru_stime


def write_variant_candidate(ckpt: str, ref: str, out: str, variant: str) -> None:
    """Child: the oracle's stages with one wiring variant applied, as an mtp-trace/1 file."""
    import torch

    from oracle.trace import read_trace, write_trace
    from oracle.variants import Explainer

    with read_trace(ref) as r:
        inputs, attrs, stage_list, dims = r.inputs(), dict(r.attrs), r.stage_list, r.dims
    ex = Explainer(ckpt, inputs)
    first, patch = ex.patches[variant]
    ops = patch(ex.ops)
    s = {n: ex.base[n] for n in ex.ops.order[:ex.ops.order.index(first)]}
    for name in ex.ops.order[len(s):]:
        s[name] = ops.compute(name, s)
    stages = {n: t.numpy().astype(np.int64 if t.dtype == torch.int64 else np.float32) for n, t in s.items()}
    keep = {k: attrs[k] for k in ("family", "checkpoint_digest") if k in attrs}
    write_trace(Path(out), inputs, stages, keep | {"producer": f"bench_explain ({variant})"}, stage_list=stage_list,
                dims=dims)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/mtp-bench/q35_27b"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/mtp-bench/explain"))
    parser.add_argument("--variant", default="rope_interleaved")
    parser.add_argument("--t", type=int, default=169)
    args = parser.parse_args()
    if not (args.checkpoint / "model.safetensors.index.json").is_file():
        subprocess.run([PY, str(ROOT / "scripts" / "make_realscale_checkpoint.py"), str(args.checkpoint)], check=True)
    args.work.mkdir(parents=True, exist_ok=True)
    ref, cand = args.work / f"ref{args.t}.h5", args.work / f"cand{args.t}-{args.variant}.h5"
    tokens = ",".join(str(int(x)) for x in np.random.default_rng(0).integers(0, 248320, args.t))
    for stale in (ref, cand):
        stale.unlink(missing_ok=True)
    export = timed([BIN / "mtp-oracle", "export", args.checkpoint, "--out", ref, "--tokens", tokens,
                    "--hidden-seed", "0", "-q"])
    timed([PY, __file__, "child-candidate", args.checkpoint, ref, cand, args.variant])
    plain = timed([BIN / "mtp-probe", "diff", ref, cand, "-q"])
    explain = timed([BIN / "mtp-probe", "diff", ref, cand, "--explain", "--checkpoint", args.checkpoint, "-q"])
    diagnosis = next((line for line in explain[2].splitlines() if line.startswith("DIAGNOSIS |")), "(none)")
    extra = explain[0] - plain[0]
    print(f"27B-shaped head, T={args.t}, candidate = oracle with {args.variant}")
    print(f"  mtp-oracle export               {export[0]:7.1f} s   cpu {export[3]:6.1f} s   peak RSS {export[1]:.2f} GB")
    print(f"  mtp-probe diff                  {plain[0]:7.1f} s   cpu {plain[3]:6.1f} s   peak RSS {plain[1]:.2f} GB")
    print(f"  mtp-probe diff --explain        {explain[0]:7.1f} s   cpu {explain[3]:6.1f} s   peak RSS {explain[1]:.2f} GB")
    print(f"  cpu-time ratio (explain part / export): {(explain[3] - plain[3]) / export[3]:.2f}x "
          f"(wall times swing 2x on a shared machine)")
    print(f"  explain part (difference)       {extra:7.1f} s   = {extra / export[0]:.2f}x the export (goal <= 3x); "
          f"whole command {explain[0] / export[0]:.2f}x")
    print(f"  {diagnosis}")
    print(json.dumps({"export_s": export[0], "diff_s": plain[0], "explain_s": explain[0], "export_cpu_s": export[3],
                      "explain_cpu_s": explain[3],
                      "ratio_explain_part": extra / export[0], "ratio_whole": explain[0] / export[0]}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child-candidate":
        write_variant_candidate(*sys.argv[2:6])
    else:
        main()
