#!/bin/bash
# Print the runs' progress every minute for at most $1 seconds, or until $2 results are written (a run's
# eval.json, an exported run's export_check.json) or $2 runs have ended (NAME.rc: one that failed has no
# result, and its eval.partial.json holds the evaluation's parts done), then pack their small files (no weights, no held-out
# text) into $OUT/runs.tgz. It checks for the results every 5 s and stops within 5 s of $1, so a call whose
# limit is $1 plus 5 s and the packing's few seconds returns with the archive (2026-11-29e: a 570-s watch that slept
# a whole minute past its end was cut at the call's 595-s limit, the results written but not packed).
start=$(date +%s)
end=$(( start + ${1:-540} ))
next=$(( start + 60 ))
while [ $(date +%s) -lt $end ]; do
  n=$(ls /root/runs/*/eval.json /root/runs/*/export_check.json 2>/dev/null | wc -l)
  if [ "$n" -ge "${2:-3}" ]; then
    # the results are written, but a run still writes its last files until it exits (NAME.rc): packing them then
    # read a folder that changed (2026-11-30i and -30j: "file changed as we read it", fetched again)
    while [ "$(ls /root/runs/*.rc 2>/dev/null | wc -l)" -lt "${2:-3}" ] && [ $(date +%s) -lt $end ]; do sleep 1; done
    break
  fi
  # every run ended (launch_runs.sh writes NAME.rc), some without their result: no more waiting
  rc=$(ls /root/runs/*.rc 2>/dev/null | wc -l); [ "$rc" -ge "${2:-3}" ] && { grep -H . /root/runs/*.rc; break; }
  if [ $(date +%s) -ge $next ]; then
    next=$(( next + 60 )); date +%T
    for f in /root/runs/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 2 | cut -c1-200; done
  fi
  sleep 5
done
cd /root/runs && tar czf $OUT/runs.tgz --exclude='*.safetensors' --exclude='checkpoints' --exclude='tokenizer*' \
  --exclude='held_out.json' --exclude='*.pt' . && ls -la $OUT
