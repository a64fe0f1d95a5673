#!/usr/bin/env bash
# The main job on the bundled fixture: export a reference trace and show what is in it.
# Run from the repository root after installing (see README.md). Each command is echoed before it runs.
set -euo pipefail
set -x
mkdir -p out
.venv/bin/mtp-oracle export fixtures/qwen3_5_tiny --out out/ref.h5 --tokens 17,42,3,255,100,7,511,64 --hidden-seed 0
.venv/bin/mtp-oracle inspect out/ref.h5
