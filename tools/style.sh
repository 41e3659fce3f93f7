#!/usr/bin/env bash
# Apply the project's style (ruff.toml): lint fixes first (imports sorted, unused ones dropped, ...), then
# the formatter. tests/test_style.py checks the same paths in CI; what this cannot fix, it prints.
# Arguments replace the paths (e.g. `bash tools/style.sh hf_altparams/plan`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$#" -gt 0 ]; then
    paths=("$@")
else
    paths=(hf_altparams tests examples benchmarks typings)  # tests/test_style.py's PATHS
fi
python -m ruff check --fix "${paths[@]}" || true  # what remains is printed; the formatter runs anyway
python -m ruff format "${paths[@]}"
python -m ruff check "${paths[@]}"  # after formatting: fails on what needs a hand
