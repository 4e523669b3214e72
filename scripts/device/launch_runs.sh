#!/bin/bash
# Start one run of scripts/results.py (a `linearize distill --max-minutes $MINUTES` command of its RUNS
# table) per preset, each on its own GPU, in the background (they outlive the call: setsid).
#   MINUTES=20 bash scripts/device/launch_runs.sh lolcats gdn gdn-hybrid gdn-hybrid-qwen3_5
# DATA: the --data mix (default: the Linux docs); EXTRA: more distill flags for every run
source "$(dirname "$0")/prepare.sh"
cp scripts/results.py scripts/benchlib.py /root/  # the runs outlive this call and this copy of the repo
gpu=0
for name in "$@"; do
  # a run in the Qwen3.5 layout is then exported and its perplexity compared (results.py export)
  then=true; [[ $name == *qwen3_5 ]] && then="python3 results.py export $name --runs /root/runs"
  (cd /root && CUDA_VISIBLE_DEVICES=$gpu TORCH_LOGS=recompiles setsid nohup bash -c "python3 results.py run $name \
    --model /root/smollm2 --data '${DATA:-/root/data/Documentation}' --runs /root/runs --minutes ${MINUTES:-20} \
    ${EXTRA:+--extra='$EXTRA'} && $then" > /root/runs/$name.log 2>&1 < /dev/null &)
  gpu=$((gpu + 1))
done
sleep 30; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
# GPU $gpu (the next free one), if any: the training benchmark on real packed documents beside random rows
if [ -n "$BENCH_GPU" ]; then
  mkdir -p /root/bench && cp -r scripts /root/bench/
  (cd /root/bench && CUDA_VISIBLE_DEVICES=$BENCH_GPU setsid nohup python3 scripts/bench_train.py --presets lolcats,gdn \
    --cuda-graphs --data /root/data/Documentation --tokenizer /root/smollm2 --json /root/runs/bench_train.json \
    --doc /root/runs/bench_train.md > /root/runs/bench_train.log 2>&1 < /dev/null &)
fi
