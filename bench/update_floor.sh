#!/usr/bin/env bash
# The 0.5B update's profile by kernel kind, then its floor from that profile's numbers, on one GPU, in one call;
# OUT gets profile.json, profile.txt, floor.txt and their manifest.json (bench/results/README.md).
#   OUT=dir bash bench/update_floor.sh     (from the repository root; docs/benchmarks.md, "The update, round 10")
set -euo pipefail
export PYTHONPATH=$PWD/src:$PWD/bench:$PWD
OUT=${OUT:-/tmp/update_floor}
mkdir -p "$OUT"
COHORT_BENCH_PROFILE_ROWS=40 python3 bench/grpo_step.py --sizes 0.5b --runners cohort --steps 2 --warmup 1 \
    --profile-update --out "$OUT/profile.json" > "$OUT/profile.txt" 2>&1
grep -A 15 "device time by kernel kind" "$OUT/profile.txt"
kind_ms() { grep "^| $1 |" "$OUT/profile.txt" | head -1 | awk -F'|' '{gsub(/ /, "", $3); print $3}'; }
# the update's mean over the measured steps: the profiled (last) step and the warm-up left out, as grpo_step.py
update_s=$(python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['results']['0.5b']['cohort']['steps'][1:-1]; \
print(sum(x['update'] for x in s) / len(s))" "$OUT/profile.json")
python3 bench/update_floor.py --attention-ms "$(kind_ms attention)" --step-matmul-ms "$(kind_ms matmul)" \
    --update-s "$update_s" 2>&1 | tee "$OUT/floor.txt"
# OUT/manifest.json (grpo_step.py wrote it for profile.json): the profile's text and the floor too
python3 bench/manifest.py "$OUT" profile.txt floor.txt --command "OUT=$OUT bash bench/update_floor.sh" \
    --what "the 0.5B update's profile by kernel kind and its floor (bench/update_floor.py)" \
    || echo "manifest not written in $OUT" >&2
