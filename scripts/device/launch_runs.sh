#!/bin/bash
# call 2 (see README.md here): assemble the model, unpack the data, start the four distillation runs in the background
set -e
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
cat /root/stash/part00 .carry_b/part01 > /root/smollm2.gguf
md5sum /root/smollm2.gguf
mkdir -p /root/data && tar xf .data/linux-doc.tar -C /root/data
cd /root && python3 - <<'PY' && cd - >/dev/null
from linearize.loading import load_model_and_tokenizer
m, t = load_model_and_tokenizer("/root/smollm2.gguf")
m.save_pretrained("/root/smollm2"); t.save_pretrained("/root/smollm2")
print("saved", sum(p.numel() for p in m.parameters()))
PY
mkdir -p /root/runs
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
cp scripts/results.py /root/results.py  # the runs outlive this call and this copy of the repo
for job in lolcats:0 linear:1 gdn:2 gdn-hybrid:3; do  # one GPU each: two runs on one H200 ran out of memory
  name=${job%:*}; gpu=${job#*:}
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup python3 /root/results.py run $name --model /root/smollm2 \
    --data /root/data/Documentation --runs /root/runs --minutes ${MINUTES:-9} > /root/runs/$name.log 2>&1 < /dev/null &
done
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
