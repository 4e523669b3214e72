#!/bin/bash
# print progress of the background runs every minute for $1 seconds; copy finished results to $OUT
end=$(( $(date +%s) + ${1:-500} ))
while [ $(date +%s) -lt $end ]; do
  sleep 60
  date +%T
  for f in /root/runs/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 2 | cut -c1-220; done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  n=$(ls /root/runs/*/eval.json 2>/dev/null | wc -l); [ "$n" -ge "${2:-4}" ] && break
done
mkdir -p $OUT/runs
cd /root/runs && tar czf $OUT/runs/results.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='*-probe' --exclude='tokenizer.json' --exclude='held_out.json' --exclude='*.py' . 2>/dev/null || true
ls -la $OUT/runs
