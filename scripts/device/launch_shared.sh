#!/bin/bash
# call 2 on a one-GPU machine (see README.md here): assemble the model, unpack the data, then start the
# named runs side by side in the background, each with micro-batches of 1/SPLIT and SPLIT-step
# accumulation (the same tokens per optimizer step in less memory, so they fit side by side).
#   MINUTES=15 bash .data/launch_shared.sh gdn-hybrid lolcats            # two runs, SPLIT=2
#   MINUTES=15 SPLIT=4 bash .data/launch_shared.sh gdn-hybrid gdn linear  # three runs
set -e
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat /root/stash/part00 .carry_b/part01 > /root/smollm2.gguf
mkdir -p /root/data && tar xf .data/linux-doc.tar -C /root/data
cd /root && python3 - <<'PY' 2>&1 | grep saved && cd - >/dev/null
from linearize.loading import load_model_and_tokenizer
m, t = load_model_and_tokenizer("/root/smollm2.gguf")
m.save_pretrained("/root/smollm2"); t.save_pretrained("/root/smollm2")
print("saved", sum(p.numel() for p in m.parameters()))
PY
mkdir -p /root/runs
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
cp scripts/results.py /root/results.py  # the runs outlive this call and this copy of the repo
for name in "$@"; do
  setsid nohup python3 /root/results.py run $name --model /root/smollm2 --data /root/data/Documentation --runs /root/runs \
    --minutes ${MINUTES:-15} --split-batch ${SPLIT:-2} > /root/runs/$name.log 2>&1 < /dev/null &
done
sleep 20; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
