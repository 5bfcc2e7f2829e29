#!/usr/bin/env bash
# The ratio-regimes dev round of docs/preregistration-ratio-regimes.md, its commands in its order. Every run resumes
# where it stopped (kvpress-phase eval), so rerunning this script continues the round; a finished run is packed and
# skipped from then on.
# Runs answer 3 samples per phase (deviation 1); the first run, begun with 8 before it, finishes with 8.
#   bash studies/run_regimes.sh            # every run, in order
#   bash studies/run_regimes.sh smollm2    # one model's runs
set -euo pipefail
P="no_press,chunked_stride,phase_aware,head_budget:floor=1.0,layer_budget:scorer=kvzap,\
global_budget:scorer=kvzap,global_budget:floor=0.25:scorer=kvzap,threshold_budget,\
snapkv,knorm,streaming_llm,chunkkv,chunk,expected_attention,tova,keydiff,pyramidkv,kvzip,kvzip_plus,adakv,kvzap,dms_kvzap"
MODELS=${1:-"smollm2 qwen2.5-coder-0.5b"}
for MODEL in $MODELS; do
  D="--model $MODEL --tasks niah_single,niah_multikey,niah_multivalue --compression-ratios 0.25,0.5,0.75 \
     --protocol offset --matched-cache --no-diagnostics --threads 2 --presses $P"
  for LEN in 1024 2048; do
    for RUN in "agnostic 10 8" "agnostic 15 12" "question 10 8" "question 15 12"; do
      set -- $RUN
      OUT=outputs/regimes-dev/$MODEL/$1-s$3-$LEN
      [ -f "$OUT/results/answers.parquet" ] && continue  # finished and packed (eval refuses a packed run)
      FLAG=""; [ "$1" = question ] && FLAG="--query-aware"
      N=3; [ "$MODEL-$1-$3-$LEN" = smollm2-agnostic-8-1024 ] && N=8
      kvpress-phase eval $D --samples $N --context-lengths $LEN --seed $2 --strides $3 $FLAG --output-dir $OUT
      kvpress-phase pack $OUT
    done
  done
done
