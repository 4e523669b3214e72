#!/bin/bash
# call 2 on a one-GPU machine (see README.md here): assemble the model, unpack the data, then start the
# named runs side by side in the background, each with micro-batches of 1/SPLIT and SPLIT-step
# accumulation (the same tokens per optimizer step in less memory, so they fit side by side).
#   MINUTES=15 bash .data/launch_shared.sh gdn-hybrid lolcats            # two runs, SPLIT=2
#   MINUTES=15 SPLIT=4 bash .data/launch_shared.sh gdn-hybrid gdn linear  # three runs
source "$(dirname "$0")/prepare.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for name in "$@"; do
  setsid nohup python3 /root/results.py run $name --model /root/smollm2 --data /root/data/Documentation --runs /root/runs \
    --minutes ${MINUTES:-15} --split-batch ${SPLIT:-2} > /root/runs/$name.log 2>&1 < /dev/null &
done
sleep 20; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
