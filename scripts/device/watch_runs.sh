#!/bin/bash
# Print the runs' progress every minute for at most $1 seconds, or until $2 runs have written eval.json,
# then pack their small files (no weights) into $OUT/runs.tgz.
end=$(( $(date +%s) + ${1:-540} ))
while [ $(date +%s) -lt $end ]; do
  n=$(ls /root/runs/*/eval.json 2>/dev/null | wc -l); [ "$n" -ge "${2:-3}" ] && break
  sleep 60; date +%T
  for f in /root/runs/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 2 | cut -c1-200; done
done
cd /root/runs && tar czf $OUT/runs.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='tokenizer*' . && ls -la $OUT
