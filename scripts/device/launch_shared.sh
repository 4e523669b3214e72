#!/bin/bash
# call 2 on a one-GPU machine (see README.md here): model + data; the GPU checks and kernel timings;
# then two distillation runs sharing the GPU in the background (half micro-batches, so both fit).
# This is how lolcats and gdn-hybrid of docs/results.md were run (the check and timings hit their
# time limits there: give them more, or run them on their own).
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
cat /root/stash/part00 .carry_b/part01 > /root/smollm2.gguf
mkdir -p /root/data && tar xf .data/linux-doc.tar -C /root/data
(cd /root && python3 - <<'PY'
from linearize.loading import load_model_and_tokenizer
m, t = load_model_and_tokenizer("/root/smollm2.gguf")
m.save_pretrained("/root/smollm2"); t.save_pretrained("/root/smollm2")
print("saved", sum(p.numel() for p in m.parameters()))
PY
) 2>&1 | grep saved
mkdir -p /root/runs/gpu3 $OUT/gpu
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
cp scripts/results.py /root/results.py
timeout 240 python3 scripts/check_kernels_gpu.py --base /root/smollm2 --out $OUT/gpu/kernels_gpu_check.md 2>&1 | grep -v Warn | tail -n 12 | cut -c1-300
timeout 200 python3 scripts/bench_kernels.py --skip-checks --T 2048 8192 32768 --out $OUT/gpu/benchmarks_kernels.md 2>&1 | grep -E "speed-up|roofline|->|window" | cut -c1-300
for name in lolcats gdn-hybrid; do
  setsid nohup python3 /root/results.py run $name --model /root/smollm2 --data /root/data/Documentation --runs /root/runs \
    --minutes ${MINUTES:-8} --extra "--batch-size 8 --grad-accum 2" > /root/runs/$name.log 2>&1 < /dev/null &
done
sleep 15; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
