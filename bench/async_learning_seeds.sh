#!/usr/bin/env bash
# Learning is not hurt by asynchronous rollouts (issue 34): RECIPE trained for the same number of steps (so the
# same number of samples) synchronously (k0: the default lock-step loop) and with train.async_rollouts=true,
# train.max_staleness=K (kK, K = STALENESS, default 1: groups streamed as they finish, partial rollouts across
# updates), for every seed,
# colocated, runs spread over the GPUs of one machine (run j on GPU j % N; the 135M model leaves room for several
# runs per GPU). The held-out accuracy of every run, the mean over seeds, its standard error and the kK - k0
# difference at every evaluation come from bench/serve_learning_table.py; OUTDIR/manifest.json lists the files.
#
#   export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MODEL=<.gguf or converted folder>
#   bash bench/async_learning_seeds.sh 1500 /tmp/async_learn 1 2 3 4      # 8 runs, 2 per GPU on 4 GPUs
#
# RECIPE defaults to recipes/chain_sum_gpu.yaml. Multi-turn recipes (recipes/calculator_agent.yaml) run
# asynchronously through a server instead (train.async_rollouts is single-turn):
#   RECIPE=recipes/calculator_agent.yaml bash bench/serve_learning_seeds.sh 300 /tmp/agent_learn 1 2 3 4
# TRAIN_ARGS: more overrides for every run (e.g. run.eval_steps=250). GPUS: which GPUs (default all). STALENESS:
# the asynchronous runs' max_staleness (default 1). MODES: "1" runs only the asynchronous runs (e.g. to complete
# seeds whose synchronous run is already in OUTDIR), "0" only the synchronous ones.
set -euo pipefail
STEPS=${1:?steps}; OUTDIR=${2:?output folder}; shift 2
SEEDS=("$@"); [ ${#SEEDS[@]} -gt 0 ] || { echo "give at least one seed after STEPS and OUTDIR" >&2; exit 2; }
RECIPE=${RECIPE:-recipes/chain_sum_gpu.yaml}; MODEL=${MODEL:-smollm2-135m-instruct}
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$N" -ge 1 ] || { echo "needs a GPU, found none" >&2; exit 2; }
# GPUS: the GPU indices to spread the runs over (default all), e.g. GPUS="1" keeps GPU 0 free for other work
read -ra G <<< "${GPUS:-$(seq -s ' ' 0 $(( N - 1 )))}"
# PER_GPU: runs at once per GPU (default 4; eight 135M runs with their engines overflowed one 141 GB H200), the
# rest start as runs end
PER_GPU=${PER_GPU:-4}
STALENESS=${STALENESS:-1}; [ "$STALENESS" -ge 1 ] || { echo "STALENESS must be at least 1, got $STALENESS" >&2; exit 2; }
# the run names' k: 0 for the synchronous run, STALENESS for the asynchronous one
KS=(); for M in ${MODES:-0 1}; do if [ "$M" = 0 ]; then KS+=(0); else KS+=("$STALENESS"); fi; done
mkdir -p "$OUTDIR"; rm -f "$OUTDIR"/seed*_k*.rc
# convert a GGUF once before the runs start (they would wait on each other's lock otherwise)
python3 -c "import sys; from cohort.policy.model import resolve_model_path as r; print(r(sys.argv[1]))" "$MODEL" | tail -n 1
j=0
for S in "${SEEDS[@]}"; do
    for K in "${KS[@]}"; do
        mode=(); [ "$K" != 0 ] && mode=(train.async_rollouts=true "train.max_staleness=$K")
        while [ "$(jobs -pr | wc -l)" -ge $(( PER_GPU * ${#G[@]} )) ]; do wait -n || true; done
        { (
            # a compile cache per run: runs that start together would otherwise compile into one folder at once
            export TORCHINDUCTOR_CACHE_DIR=${TMPDIR:-/tmp}/cohort_inductor_$$_$j
            CUDA_VISIBLE_DEVICES=${G[$(( j % ${#G[@]} ))]} python3 -m cohort.cli train "$RECIPE" "model.name_or_path=$MODEL" \
                "train.seed=$S" "train.max_steps=$STEPS" train.max_train_time_s=null run.save_only_model=true \
                run.save_steps=0 "run.output_dir=$OUTDIR/seed${S}_k$K" "${mode[@]}" ${TRAIN_ARGS:-} 2>&1 \
                | grep -v "^step " > "$OUTDIR/seed${S}_k$K.txt"
            cp "$OUTDIR/seed${S}_k$K/metrics.jsonl" "$OUTDIR/seed${S}_k${K}_metrics.jsonl"
        ) && rc=0 || rc=$?; echo "$rc" > "$OUTDIR/seed${S}_k$K.rc"; } &
        j=$(( j + 1 ))
    done
done
wait
failed=$(cat "$OUTDIR"/seed*_k*.rc | grep -cv '^0$' || true)
python3 bench/serve_learning_table.py "$OUTDIR"
files=(); for S in "${SEEDS[@]}"; do for K in "${KS[@]}"; do
    [ -f "$OUTDIR/seed${S}_k${K}_metrics.jsonl" ] && files+=("seed${S}_k$K.txt" "seed${S}_k${K}_metrics.jsonl")
done; done
python3 bench/manifest.py "$OUTDIR" "${files[@]}" \
    --command "RECIPE=$RECIPE STALENESS=$STALENESS bash bench/async_learning_seeds.sh $STEPS $OUTDIR ${SEEDS[*]}" \
    --what "$RECIPE: synchronous (k0) against train.async_rollouts with max_staleness $STALENESS (k$STALENESS), seeds ${SEEDS[*]}, $STEPS steps" \
    || echo "manifest not written" >&2
[ "$failed" -eq 0 ] || { echo "$failed run(s) failed: see $OUTDIR/seed*_k*.txt" >&2; exit 1; }
