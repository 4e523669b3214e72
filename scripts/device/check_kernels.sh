#!/bin/bash
# A lease's kernel check, in the background while the data travels (scripts/device/README.md): the GPU
# tests of the window kernels beside their fuzz, then the training benchmark of the sinks on its own (a
# benchmark beside the fuzz would time the fuzz). Logs and results in /root/check/; /root/check/done marks
# the end, for launch_runs.sh's AFTER. From the repository root, after the wheels are installed:
#   setsid nohup bash scripts/device/check_kernels.sh > /dev/null 2>&1 < /dev/null &
# TESTS, OPS (the fuzz's --ops) and PRESETS (bench_train's --presets) change what it checks (TESTS=none,
# OPS=none: no tests, no fuzz, when no kernel changed); BENCH (default --profile: one more step of each row
# under torch.profiler, its top kernels in training.md) adds bench flags. PREFILL (e.g. "hedgehog lolcats"):
# first, scripts/profile_prefill.py's one-call 64K-token prefill of each preset, alone on the GPU, into
# /root/check/prefill_<preset>.txt (time and top kernels). PRESETS=none: no training benchmark. E2E (e.g.
# "--presets lolcats --parts prefill"): then scripts/bench_e2e.py on the SmolLM2 shape with those flags, the
# original beside each preset in one process, into /root/check/e2e.json (log e2e.log; at most 7 minutes).
# KBENCH (e.g. bench_kernels_channel.py): a kernel benchmark script after the tests (below).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
rm -rf /root/check && mkdir -p /root/check && cp -r tests scripts benchmarks /root/check/
for preset in ${PREFILL:-}; do
  (cd /root/check/scripts && timeout 240 python3 profile_prefill.py --preset $preset -T 65536 \
    > /root/check/prefill_$preset.txt 2>&1)
done
tests=${TESTS:-test_kernels_sinks.py test_kernels_window_packed.py}
# the tests from /tmp: from the repository root the source tree, not the installed kernels, is imported
[ "$tests" = none ] || (cd /tmp && timeout 420 python3 -m pytest -q -p no:cacheprovider \
  $(printf '/root/check/tests/%s ' $tests) > /root/check/pytest.log 2>&1) &
[ "${OPS:-}" = none ] || (cd /root/check/scripts && timeout 300 python3 fuzz_kernels_gpu.py --ops "${OPS:-window}" \
  --workers 12 --max-minutes 3.5 --out /root/check/kernels.md > /root/check/fuzz.log 2>&1) &
wait
# KBENCH (e.g. bench_kernels_channel.py, fla-core installed beside the wheel): a kernel benchmark script, alone on
# the GPU, its section into /root/check/kbench.md and its records into kbench.json
[ -z "${KBENCH:-}" ] || (cd /root/check/scripts && timeout 300 python3 $KBENCH --out /root/check/kbench.md \
  --json /root/check/kbench.json > /root/check/kbench.log 2>&1)
[ "${PRESETS:-}" = none ] || (cd /root/check/scripts && timeout 420 python3 bench_train.py --packed --cuda-graphs --stages 2 \
  --presets "${PRESETS:-lolcats,lolcats:sinks=0}" ${BENCH---profile} --json /root/check/train.json --doc /root/check/training.md \
  > /root/check/bench.log 2>&1)
[ -z "${E2E:-}" ] || (cd /root/check/scripts && timeout 420 python3 bench_e2e.py --shapes smollm2-135m $E2E \
  --json /root/check/e2e.json > /root/check/e2e.log 2>&1)
touch /root/check/done
