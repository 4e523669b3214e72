#!/bin/bash
# Sourced by launch_runs.sh on the GPU machine (see README.md here): install the carried wheels, join the
# GGUF halves into the teacher's HF folder (/root/smollm2), unpack the data (/root/data/Documentation).
set -e
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
[ -d /tmp/site/linearize ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
if [ ! -f /root/smollm2/config.json ]; then
  cat /root/stash/part00 .carry_b/part01 > /root/smollm2.gguf
  (cd /root && python3 -c '
from linearize.loading import load_model_and_tokenizer
m, t = load_model_and_tokenizer("/root/smollm2.gguf")
m.hf_quantizer.remove_quantization_config(m) if getattr(m, "hf_quantizer", None) else None
m.save_pretrained("/root/smollm2"); t.save_pretrained("/root/smollm2"); print("teacher saved")')
fi
mkdir -p /root/data /root/runs
[ -d /root/data/Documentation ] || tar xf .data/linux-doc.tar -C /root/data
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
