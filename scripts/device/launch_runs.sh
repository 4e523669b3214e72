#!/bin/bash
# call 2 (see README.md here): assemble the model, unpack the data, start the four distillation runs in the background
source "$(dirname "$0")/prepare.sh"
for job in lolcats:0 linear:1 gdn:2 gdn-hybrid:3; do  # one GPU each: two runs on one H200 ran out of memory
  name=${job%:*}; gpu=${job#*:}
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup python3 /root/results.py run $name --model /root/smollm2 \
    --data /root/data/Documentation --runs /root/runs --minutes ${MINUTES:-9} > /root/runs/$name.log 2>&1 < /dev/null &
done
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
