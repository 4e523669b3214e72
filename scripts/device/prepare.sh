#!/bin/bash
# sourced by the launch scripts in call 2 (see README.md here): join the GGUF halves, save the model
# as an HF folder, unpack the data, and leave results.py where the background runs outlive the call
set -e
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
mkdir -p /root/runs
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
cp scripts/results.py /root/results.py  # the runs outlive this call and this copy of the repo
