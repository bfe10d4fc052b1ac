#!/usr/bin/env bash
# The calculator-agent learning run of docs/benchmarks.md ("Agents"), on one GPU, in phases that each fit a
# 10-minute device call. MODEL is SmolLM2-135M-Instruct's GGUF file; RUN the run directory; OUT where the
# metrics, samples and curves are copied, with a manifest.json (bench/results/README.md).
#   base   : held-out accuracy of the base model without the tool (the chain_sum_gpu instruction, no tools,
#            no examples) and with it (the recipe as is), greedy, 400 problems
#   train  : the recipe, stopping after TIME_LIMIT seconds of wall time with a checkpoint (run.time_limit_s)
#   resume : continues the run to its 10 minutes of training time and the final held-out evaluation
set -euo pipefail
phase=$1; MODEL=${MODEL:?}; RUN=${RUN:?}; OUT=${OUT:-/tmp/out}; TIME_LIMIT=${TIME_LIMIT:-450}
recipe=recipes/calculator_agent.yaml
mkdir -p "$OUT"
case $phase in
  base)
    cohort eval $recipe model.name_or_path="$MODEL" agent.tools=[] data.few_shot=[] model.chat_template=null \
      data.system_prompt=null "data.options.instruction=Solve it step by step, then give the final answer as a number on the last line." \
      --samples "$OUT/base_without_tool.jsonl" 2>&1 | grep -v "Converting\|Loading weights" | tail -4
    cohort eval $recipe model.name_or_path="$MODEL" --samples "$OUT/base_with_tool.jsonl" 2>&1 \
      | grep -v "Converting\|Loading weights" | tail -4 ;;
  train)
    cohort train $recipe model.name_or_path="$MODEL" run.output_dir="$RUN" run.time_limit_s="$TIME_LIMIT" 2>&1 \
      | grep -v "Converting\|Loading weights" | tail -40 ;;
  resume)
    cohort train $recipe model.name_or_path="$MODEL" run.output_dir="$RUN" --resume 2>&1 \
      | grep -v "Converting\|Loading weights" | tail -40 ;;
esac
cp "$RUN"/metrics.jsonl "$RUN"/samples.jsonl "$RUN"/*.png "$OUT"/ 2>/dev/null || true
python3 bench/manifest.py "$OUT" --command "MODEL=$MODEL RUN=$RUN OUT=$OUT bash bench/calculator_agent.sh $phase" \
    --what "the calculator-agent run (recipes/calculator_agent.yaml), phase $phase" || echo "manifest not written" >&2
