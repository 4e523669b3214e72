#!/bin/bash
# Start one `linearize distill --max-minutes $MINUTES` run per preset, each on its own GPU, in the
# background (they outlive the call: setsid). The recipe of docs/reports/quality.md on the Linux docs.
#   MINUTES=20 bash scripts/device/launch_runs.sh lolcats gdn gdn-hybrid
source "$(dirname "$0")/prepare.sh"
COMMON="--data /root/data/Documentation --seq-len 1024 --batch-size 16 --mixed-precision bf16 --compile --cuda-graphs
  --save-every 0 --eval-rows 64 --eval-prompts 32 --passkey 1024,2048,4096,8192 --passkey-trials 20
  --max-skipped-steps 10 --max-minutes ${MINUTES:-20}"
declare -A FLAGS=(
  [lolcats]="--preset lolcats"
  [linear]="--preset linear"
  [gdn]="--preset gdn --finetune full --stage2-lr 1e-4"
  [gdn-hybrid]="--preset gdn --finetune full --stage2-lr 1e-4 --softmax-layers auto:8"
)
gpu=0
cd /tmp  # the checkout's linearize/ lacks the kernels and recipes the wheel maps in
for name in "$@"; do
  echo "linearize distill /root/smollm2 --out /root/runs/$name ${FLAGS[$name]} $COMMON" > /root/runs/$name.command.txt
  CUDA_VISIBLE_DEVICES=$gpu TORCH_LOGS=recompiles setsid nohup python3 -m linearize.cli distill /root/smollm2 \
    --out /root/runs/$name --overwrite ${FLAGS[$name]} $COMMON > /root/runs/$name.log 2>&1 < /dev/null &
  gpu=$((gpu + 1))
done
sleep 30; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
