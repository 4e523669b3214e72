#!/bin/bash
# Sourced by launch_runs.sh on the GPU machine (see README.md here): install the carried wheels, join the
# GGUF halves into the teacher's HF folder (/root/smollm2), unpack the data: linux-doc.tar into
# /root/data/Documentation, and every corpus archive of scripts/device/corpus.py (<source>[-N].tar.xz),
# carried now in .data/ (or a folder of it) or by earlier calls into /root/stash/, into /root/data/<source>/.
set -e
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# one run per GPU shares the host: each takes its share of the cores for intra-op threads, as torchrun
# would (a lead, not yet measured: stage 1 ran at 8.5 steps/s while the other runs still loaded, 5-6 once
# all four trained, docs/reports/training.md)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 4 ))}
[ -d /tmp/site/linearize ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
if [ ! -f /root/smollm2/config.json ]; then
  cat /root/stash/part?? .carry_b/part?? > /root/smollm2.gguf  # the GGUF in parts, in order (the glob sorts)
  (cd /root && python3 -c '
from linearize.loading import load_model_and_tokenizer
m, t = load_model_and_tokenizer("/root/smollm2.gguf")
m.hf_quantizer.remove_quantization_config(m) if getattr(m, "hf_quantizer", None) else None
m.save_pretrained("/root/smollm2"); t.save_pretrained("/root/smollm2"); print("teacher saved")')
fi
mkdir -p /root/data /root/runs
for tar in .data/linux-doc.tar .data/*/linux-doc.tar /root/stash/linux-doc.tar; do
  [ -d /root/data/Documentation ] || [ ! -f $tar ] || tar xf $tar -C /root/data
done
python3 - <<'EOF'
import glob, pathlib, tarfile
done = pathlib.Path("/root/data/.unpacked")  # an archive's name once unpacked: a later call skips it
done.mkdir(parents=True, exist_ok=True)
for path in sorted(glob.glob(".data/*.tar.xz") + glob.glob(".data/*/*.tar.xz") + glob.glob("/root/stash/*.tar.xz")):
    name = pathlib.Path(path).name
    if not (done / name).exists():
        with tarfile.open(path) as tar:
            tar.extractall("/root/data")
        (done / name).touch()
        print("unpacked", name)
print("data:", " ".join(sorted(p.name for p in pathlib.Path("/root/data").iterdir() if not p.name.startswith("."))))
EOF
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > /root/runs/device.txt
