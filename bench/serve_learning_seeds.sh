#!/usr/bin/env bash
# Several seeds of bench/serve_learning.sh at once, k = 0 and k = STALENESS (default 1) for each, on all the GPUs
# of one machine:
# run j trains on GPU j % N and is served from GPU (j + 1) % N, so every GPU holds as many trainers as servers
# (the 135M model leaves each GPU mostly idle; SERVE_ARGS keeps every server's KV cache small). Each run's
# output and metrics go to OUTDIR/seed<S>_k<K>.txt and OUTDIR/seed<S>_k<K>_metrics.jsonl, and a table of the
# held-out accuracy at every evaluation is printed at the end (bench/serve_learning_table.py); OUTDIR/manifest.json
# lists those files (bench/results/README.md). On one GPU every trainer and its server share it (the weights then
# travel over gloo through host memory: NCCL cannot put both ends on one GPU).
#
#   export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MODEL=<converted folder>
#   bash bench/serve_learning_seeds.sh 300 /tmp/learn 2 3 4 5        # 8 runs on 4 GPUs, about 5 minutes
set -euo pipefail
# one key for the server and the trainer (`cohort serve` authenticates every request; docs/serving.md)
export COHORT_API_KEY=${COHORT_API_KEY:-$(python3 -c "import secrets; print(secrets.token_hex(16))")}
STEPS=${1:?steps}; OUTDIR=${2:?output folder}; shift 2
SEEDS=("$@"); [ ${#SEEDS[@]} -gt 0 ] || { echo "give at least one seed after STEPS and OUTDIR" >&2; exit 2; }
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$N" -ge 1 ] || { echo "needs a GPU, found none" >&2; exit 2; }
# GPUS: the GPU indices to spread the runs over (default all), e.g. GPUS="1" keeps GPU 0 free for other work;
# PORT_BASE (default 8011): run j serves on PORT_BASE + j (two of these scripts at once need different ones)
read -ra G <<< "${GPUS:-$(seq -s ' ' 0 $(( N - 1 )))}"; N=${#G[@]}
# one GPU: every run's trainer and its server share it (a learning check, not a speed one)
[ "$N" -ge 2 ] || echo "one GPU: every trainer and its server share GPU ${G[0]}" >&2
export SERVE_ARGS=${SERVE_ARGS:---kv-cache-fraction 0.1}
# PER_GPU: runs (trainer + server) at once per GPU (default 2: four calculator-agent trainers of 21-40 GB and
# their servers overflowed one 141 GB H200); the rest start as runs end
PER_GPU=${PER_GPU:-2}
# STALENESS: the max_staleness of the runs compared with k = 0 (default 1)
STALENESS=${STALENESS:-1}; [ "$STALENESS" -ge 1 ] || { echo "STALENESS must be at least 1, got $STALENESS" >&2; exit 2; }
mkdir -p "$OUTDIR"; rm -f "$OUTDIR"/seed*_k*.rc
j=0
for S in "${SEEDS[@]}"; do
    for K in 0 "$STALENESS"; do
        while [ "$(jobs -pr | wc -l)" -ge $(( PER_GPU * N )) ]; do wait -n || true; done
        { (
            export TRAINER_GPU=${G[$(( j % N ))]} ENGINE_GPU=${G[$(( (j + 1) % N ))]} PORT=$(( ${PORT_BASE:-8011} + j ))
            export TRAIN_ARGS="train.seed=$S run.save_only_model=true ${TRAIN_ARGS:-}"
            bash bench/serve_learning.sh "$K" "$STEPS" "$OUTDIR/seed${S}_k$K" > "$OUTDIR/seed${S}_k$K.txt" 2>&1
            cp "$OUTDIR/seed${S}_k$K/run/metrics.jsonl" "$OUTDIR/seed${S}_k${K}_metrics.jsonl"
        ) && rc=0 || rc=$?; echo "$rc" > "$OUTDIR/seed${S}_k$K.rc"; } &
        j=$(( j + 1 ))
    done
done
wait
failed=$(cat "$OUTDIR"/seed*_k*.rc | grep -cv '^0$' || true)
python3 bench/serve_learning_table.py "$OUTDIR"
files=(); for S in "${SEEDS[@]}"; do for K in 0 "$STALENESS"; do files+=("seed${S}_k$K.txt" "seed${S}_k${K}_metrics.jsonl"); done; done
python3 bench/manifest.py "$OUTDIR" "${files[@]}" --command "STALENESS=$STALENESS bash bench/serve_learning_seeds.sh $STEPS $OUTDIR ${SEEDS[*]}" \
    --what "served learning, max_staleness 0 and $STALENESS, seeds ${SEEDS[*]}, $STEPS steps" || echo "manifest not written" >&2
[ "$failed" -eq 0 ] || { echo "$failed run(s) failed: see $OUTDIR/seed*_k*.txt" >&2; exit 1; }
