#!/usr/bin/env bash
# Learning is not hurt by bounded staleness: RECIPE (default recipes/chain_sum_gpu.yaml) trained against `cohort serve` (GPU 1
# serves, GPU 0 trains) for the same number of steps with train.max_staleness=K; compare the held-out accuracy
# it prints with the K=0 run's (docs/serving.md). One device call per K on 2 GPUs, about 6-8 minutes each:
#
#   export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false && bash bench/serve_learning.sh 0 600 $OUT/k0
#   export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false && bash bench/serve_learning.sh 1 600 $OUT/k1
#
# On 4 GPUs both runs at once (GPUs 0/1 and 2/3), MODEL a converted model folder or a .gguf file:
#
#   ENGINE_GPU=1 TRAINER_GPU=0 PORT=8011 bash bench/serve_learning.sh 0 400 /tmp/k0 &
#   ENGINE_GPU=3 TRAINER_GPU=2 PORT=8012 bash bench/serve_learning.sh 1 400 /tmp/k1; wait
#
# or on 2 GPUs, crossed (each GPU holds one run's server and the other's trainer; SERVE_ARGS leaves room):
#
#   export SERVE_ARGS="--kv-cache-fraction 0.2"
#   ENGINE_GPU=1 TRAINER_GPU=0 PORT=8011 bash bench/serve_learning.sh 0 300 /tmp/k0 &
#   ENGINE_GPU=0 TRAINER_GPU=1 PORT=8012 bash bench/serve_learning.sh 1 300 /tmp/k1; wait
set -euo pipefail
# one key for the server and the trainer (`cohort serve` authenticates every request; docs/serving.md)
export COHORT_API_KEY=${COHORT_API_KEY:-$(python3 -c "import secrets; print(secrets.token_hex(16))")}
K=${1:?max_staleness}; STEPS=${2:-600}; OUTDIR=${3:-runs/serve_learning_k$K}; PORT=${PORT:-8011}
MODEL=${MODEL:-smollm2-135m-instruct}
RECIPE=${RECIPE:-recipes/chain_sum_gpu.yaml}  # recipes/calculator_agent.yaml: multi-turn through the server
mkdir -p "$OUTDIR"
CUDA_VISIBLE_DEVICES=${ENGINE_GPU:-1} python3 -m cohort.cli serve "$MODEL" --port "$PORT" ${SERVE_ARGS:-} \
    > "$OUTDIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
start=$(date +%s)
CUDA_VISIBLE_DEVICES=${TRAINER_GPU:-0} python3 -m cohort.cli train "$RECIPE" "model.name_or_path=$MODEL" \
    generation.placement=server "generation.server_address=127.0.0.1:$PORT" generation.server_connect_timeout_s=300 \
    "train.max_staleness=$K" "train.max_steps=$STEPS" train.max_train_time_s=null "run.output_dir=$OUTDIR/run" ${TRAIN_ARGS:-} \
    2>&1 | grep -v "^step " | tail -n 12
echo "max_staleness=$K steps=$STEPS wall=$(( $(date +%s) - start )) s"
tail -n 1 "$OUTDIR/run/metrics.jsonl" | python3 -c "import json,sys; m=json.loads(sys.stdin.read()); print({k: round(v, 4) for k, v in m.items() if k.startswith(('eval/', 'staleness', 'sampling/importance')) or k in ('step', 'train_time')})"
