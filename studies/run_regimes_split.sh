#!/usr/bin/env bash
# The fresh test split of docs/preregistration-ratio-regimes.md, run once, after its "Frozen configuration" is
# committed. Every run resumes where it stopped (kvpress-phase eval), so rerunning this script continues the split;
# a finished run is packed and skipped from then on.
#   bash studies/run_regimes_split.sh SPEC[,SPEC...]            # the frozen recommendation's press specs, every run
#   bash studies/run_regimes_split.sh SPEC[,SPEC...] smollm2    # one model's runs
# Each SPEC must stand in the pre-registration's "Frozen configuration" (committed), or the script refuses to start.
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: bash studies/run_regimes_split.sh SPEC[,SPEC...] [MODEL ...]" >&2
  exit 2
fi
CHOSEN=$1; shift
PREREG=docs/preregistration-ratio-regimes.md
FROZEN=$(git show HEAD:$PREREG | sed -n '/^## Frozen configuration/,/^## Deviations/p')
IFS=, read -ra SPECS <<< "$CHOSEN"
for SPEC in "${SPECS[@]}"; do
  if ! grep -qF "\`$SPEC\`" <<< "$FROZEN"; then
    echo "run_regimes_split: \`$SPEC\` is not in the committed \"Frozen configuration\" of $PREREG;" \
         "write and commit the frozen configuration before the split's first answer" >&2
    exit 2
  fi
done
FIXED="no_press,chunked_stride,phase_aware,head_budget:floor=1.0,layer_budget:scorer=kvzap"
BASELINES="snapkv,knorm,streaming_llm,chunkkv,chunk,expected_attention,tova,keydiff,pyramidkv,kvzip,kvzip_plus,\
adakv,kvzap,dms_kvzap"
# the chosen specs after the fixed ones, each press once
P=$(printf '%s\n' ${FIXED//,/ } "${SPECS[@]}" ${BASELINES//,/ } | awk '!seen[$0]++' | paste -sd,)
MODELS=${*:-"smollm2 qwen2.5-coder-0.5b"}
for MODEL in $MODELS; do
  D="--model $MODEL --tasks niah_single,niah_multikey --compression-ratios 0.25,0.5,0.75 --strides 7,14 \
     --seed 53 --samples 8 --protocol offset --matched-cache --no-diagnostics --threads 2 --presses $P"
  for LEN in 1024 2048; do
    for SETTING in agnostic question; do
      OUT=outputs/regimes-test/$MODEL/$SETTING-$LEN
      [ -f "$OUT/results/answers.parquet" ] && continue  # finished and packed (eval refuses a packed run)
      FLAG=""; [ "$SETTING" = question ] && FLAG="--query-aware"
      kvpress-phase eval $D --context-lengths $LEN $FLAG --output-dir $OUT
      kvpress-phase pack $OUT
    done
  done
done
