#!/bin/bash
# Issue 14's multi-GPU figures on one 4-GPU machine (nvidia-h100-x4 / nvidia-h200-x4), two calls,
# each after the preamble of README.md here (the wheel in /tmp/site). Every call keeps four training
# processes on the host, so the 1-process rows see the host load of the 4-process run:
#   bash scripts/device/train_scaling.sh one   # GPU 0: lolcats, GPU 1: gdn (1 process each), GPUs 2-3: gdn on 2
#   bash scripts/device/train_scaling.sh four  # lolcats and gdn on 4 processes
#   bash scripts/device/train_scaling.sh alone # the 1-process rows of both presets with nothing beside them
#                                              # (GPU 0; the baseline the scaling figures should use)
# The second call finds the first's compiled graphs in Inductor's cache (same machine, same graphs:
# dynamo's DDP graph splitting is off). Records go to /tmp/o/training_speed.json (scaling needs the
# 1-process rows of the same device) and come back as $OUT/train.tgz.
set -u
mkdir -p /tmp/o
J=/tmp/o/training_speed.json
LAUNCH="python3 -m accelerate.commands.launch --multi_gpu --num_machines 1 --mixed_precision bf16 --dynamo_backend no"
case "$1" in
one)
  (CUDA_VISIBLE_DEVICES=0 timeout ${T:-540} python3 scripts/bench_train.py --presets lolcats --json /tmp/o/l1.json --doc /tmp/o/l1.md > /tmp/o/l1.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 timeout ${T:-540} python3 scripts/bench_train.py --presets gdn --json /tmp/o/g1.json --doc /tmp/o/g1.md > /tmp/o/g1.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=2,3 timeout ${T:-540} $LAUNCH --num_processes 2 --main_process_port 29611 scripts/bench_train.py --presets gdn --no-optimize-ddp --json /tmp/o/g2.json --doc /tmp/o/g2.md > /tmp/o/g2.log 2>&1) &
  wait
  ;;
alone)
  CUDA_VISIBLE_DEVICES=0 timeout ${T:-560} python3 scripts/bench_train.py --presets lolcats,gdn --json /tmp/o/t1.json --doc /tmp/o/t1.md > /tmp/o/t1.log 2>&1
  ;;
four)
  timeout ${T:-560} $LAUNCH --num_processes 4 scripts/bench_train.py --presets lolcats,gdn --no-optimize-ddp --json /tmp/o/lg4.json --doc /tmp/o/lg4.md > /tmp/o/lg4.log 2>&1
  ;;
esac
nvidia-smi --query-gpu=index,name,memory.used --format=csv
tail -n 4 /tmp/o/*.log
tar czf $OUT/train.tgz -C /tmp o
