#!/bin/bash
# Print the runs' progress every minute for at most $1 seconds, or until $2 results are written (a run's
# eval.json, an exported run's export_check.json), then pack their small files (no weights, no held-out
# text) into $OUT/runs.tgz.
end=$(( $(date +%s) + ${1:-540} ))
while [ $(date +%s) -lt $end ]; do
  n=$(ls /root/runs/*/eval.json /root/runs/*/export_check.json 2>/dev/null | wc -l); [ "$n" -ge "${2:-3}" ] && break
  sleep 60; date +%T
  for f in /root/runs/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 2 | cut -c1-200; done
done
cd /root/runs && tar czf $OUT/runs.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='tokenizer*' \
  --exclude='held_out.json' --exclude='*.pt' . && ls -la $OUT
