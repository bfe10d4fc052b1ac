#!/usr/bin/env bash
# train.deterministic on the GPU chain_sum recipe (issue 39): two runs of 50 steps with the same seed give the
# same final weights (SHA-256 of the checkpoint's safetensors) and the same metrics (metrics.jsonl without its
# wall-clock columns), on one GPU and on two (torchrun); one run without the setting gives its cost in s/step.
#
#   MODEL=/root/keep/smollm2.gguf OUT=$OUT bash bench/deterministic.sh one    # 1 GPU: det, det, plain
#   MODEL=/root/keep/smollm2.gguf OUT=$OUT bash bench/deterministic.sh two    # 2 GPUs: det, det
#
# COHORT: the cohort command (default `cohort`; "python3 -m cohort.cli" where it is only on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-bench/results/$(date +%F)-deterministic}
STEPS=${STEPS:-50}
COHORT=${COHORT:-cohort}
WORK=${WORK:-/tmp/det}
mkdir -p "$OUT" "$WORK"
common=(recipes/chain_sum_gpu.yaml model.name_or_path="$MODEL" train.max_steps="$STEPS" run.eval_steps=0
        data.eval_size=0 run.save_steps=0 run.overwrite=true)

run() {  # name, launcher..., then overrides after --
  local name=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  "${launcher[@]}" train "${common[@]}" run.output_dir="$WORK/$name" "$@" > "$OUT/$name.log" 2>&1
  sha256sum "$WORK/$name"/checkpoints/step-*/*.safetensors | awk '{print $1}' | sort | sha256sum | cut -c1-16 \
    > "$OUT/$name.weights_sha"
  python3 - "$WORK/$name/metrics.jsonl" "$OUT/$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keep = [{k: v for k, v in r.items() if not k.startswith(("time", "step_time", "train_time", "throughput", "mfu"))}
        for r in rows]
json.dump(keep, open(sys.argv[2] + ".metrics.json", "w"))
times = [r["step_time"] for r in rows[5:] or rows]  # the first steps compile and capture
print(f"{sys.argv[2]}: {len(rows)} steps, median s/step {statistics.median(times):.4f}")
json.dump({"median_step_s": statistics.median(times)}, open(sys.argv[2] + ".timing.json", "w"))
PY
}

same() {  # two run names: weights and metrics bitwise equal?
  if cmp -s "$OUT/$1.weights_sha" "$OUT/$2.weights_sha" && cmp -s "$OUT/$1.metrics.json" "$OUT/$2.metrics.json"; then
    echo "$1 == $2: identical weights ($(cat "$OUT/$1.weights_sha")) and metrics" | tee -a "$OUT/summary.txt"
  else
    echo "$1 != $2: weights $(cat "$OUT/$1.weights_sha") vs $(cat "$OUT/$2.weights_sha")" | tee -a "$OUT/summary.txt"
  fi
}

case "${1:-}" in
  one)
    run det1 $COHORT -- train.deterministic=true
    run det2 $COHORT -- train.deterministic=true
    run plain1 $COHORT --
    run plain2 $COHORT --
    same det1 det2
    same plain1 plain2
    ;;
  two)
    tr=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m cohort.cli)
    run two_det1 "${tr[@]}" -- train.deterministic=true
    run two_det2 "${tr[@]}" -- train.deterministic=true
    same two_det1 two_det2
    ;;
  *) echo "usage: bash bench/deterministic.sh one|two" >&2; exit 2 ;;
esac
python3 bench/manifest.py "$OUT" --what "train.deterministic: repeated chain_sum_gpu runs of $STEPS steps, weights \
hash and metrics compared; s/step with and without" --command "MODEL=$MODEL bash bench/deterministic.sh ${1}"
