#!/usr/bin/env bash
# The main job on the bundled fixture: export a reference trace, show what is in it, then question candidates
# against it. Run from the repository root after installing (README.md). Each command is echoed before it runs.
set -euo pipefail
set -x
mkdir -p out
.venv/bin/mtp-oracle export fixtures/qwen3_5_tiny --out out/ref.h5 --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0
.venv/bin/mtp-oracle inspect out/ref.h5
# A C engine step behind the C ABI (fixtures/candidates/mtp_probe.h): build it, run it on the reference's inputs.
gcc -O2 -std=c11 -shared -fPIC -Ifixtures/candidates fixtures/candidates/mtp_step.c -o out/mtp_step.so -lm
.venv/bin/mtp-probe run out/ref.h5 --impl c:out/mtp_step.so --out out/cand_c.h5 --json out/report.json
# The same step with a classic wiring bug (concat order [h, e]): exit 1, localised to fc_in at token 0.
gcc -O2 -std=c11 -shared -fPIC -DMTP_MUTANT_CONCAT_SWAP -Ifixtures/candidates fixtures/candidates/mtp_step.c \
    -o out/mtp_step_swapped.so -lm
.venv/bin/mtp-probe run out/ref.h5 --impl c:out/mtp_step_swapped.so --plot out/swapped.png \
    --html out/swapped.html | tail -3 || true
# Diff a trace file someone already wrote.
.venv/bin/mtp-probe diff out/ref.h5 out/cand_c.h5 | tail -1
# Before trusting a verdict on your engine: the probe catches every known mutant on itself.
.venv/bin/mtp-probe selftest 2>/dev/null | tail -1
# What the head is worth: conditional acceptance on a tiny trained model and held-out text.
.venv/bin/mtp-oracle accept fixtures/qwen3_5_trained --tokens-file fixtures/qwen3_5_trained/heldout_tokens.txt \
    --main-model -q | tail -1
# Every other family, on its tiny fixture (README "Exporting a reference trace"): a reference trace each; the
# MoE Qwen heads are then run through an example numpy candidate (fixtures/candidates/numpy_moe_step.py).
for family in qwen3_5_moe qwen3_next deepseek_v3 glm4_moe deepseek_v4 step3p7 mimo_v2_flash; do
    fixture=fixtures/${family}_tiny
    [ -d "$fixture" ] || fixture=fixtures/${family}_tiny_fused
    .venv/bin/mtp-oracle export "$fixture" --out "out/${family}.h5" --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0 -q
    .venv/bin/mtp-oracle inspect "out/${family}.h5" | head -1
done
.venv/bin/mtp-oracle export fixtures/inkling_tiny --out out/inkling.h5 --tokens 17,42,3,245,100,7,211,64 --hidden-seed 0 \
    --chain 3 -q
.venv/bin/mtp-oracle inspect out/inkling.h5 | head -1
for family in qwen3_5_moe qwen3_next; do
    PYTHONPATH=fixtures/candidates .venv/bin/mtp-probe run "out/${family}.h5" --impl python:numpy_moe_step:make_head \
        -q | tail -1
done
set +x
echo "demo: pictures in out/: swapped.png (the heatmap of the concat-swap run), swapped.html (its HTML report);" \
     "traces and reports: out/ref.h5, out/cand_c.h5, out/report.json, out/<family>.h5"
