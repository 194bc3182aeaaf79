#!/usr/bin/env bash
# The offline GPU validation of redraft: stage the carried bundle parts, install them into a
# private prefix, run the requested stages, write everything to $OUT. dev/gpu/README.md has the
# procedure; `dev/gpu/gpu-run.sh --help` lists the options; the logic is dev/gpu/gpu_run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" dev/gpu/gpu_run.py "$@"
