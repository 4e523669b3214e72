#!/bin/bash
# Start one run of scripts/results.py (a `linearize distill --max-minutes $MINUTES` command of its RUNS
# table) per preset, each on its own GPU (more runs than GPUs: they share them round-robin), in the
# background (they outlive the call: setsid).
#   MINUTES=20 bash scripts/device/launch_runs.sh lolcats gdn gdn-hybrid gdn-hybrid-qwen3_5
# NAME@BASE runs NAME's long-row stage on BASE's stages 1-2 once they are done (results.py run --from):
#   bash scripts/device/launch_runs.sh lolcats-hybrid lolcats-hybrid-long-same@lolcats-hybrid
# GPUS_PER_RUN=P: each run on P GPUs at once (accelerate launch, DDP: results.py run --processes P)
# DATA: the --data mix (default: the Linux docs); EXTRA: more distill flags for every run
# CHAT_MINUTES (default 0: off): first have the teacher answer chat prompts for that many minutes, one
# `generate-data --shard g/N` per run's GPU, into /root/data/chat/part-g.jsonl (also copied to
# /root/runs/chat/), then start the runs with /root/data/chat@$CHAT_WEIGHT (default 1) added to DATA;
# all in one background job (log: /root/runs/chat.log), so this call returns at once. CHAT_BATCH: prompts a
# batch (default 1024: 15.6K tokens/s an H200, 2026-11-28e; 256 gave 12.5K, 2026-11-28c; a decode step
# bound by its ~20 ms of overhead, not by the 135M model's arithmetic). CHAT_SEED (default 0): the sampling seed; a
# seed other than 0 writes /root/data/chat-seedS/ (back as chat-seedS/ in runs.tgz), a second answer to each prompt
# beside the carried ones (seed 0 had used 42,127 of the 44,578 train prompts by 2026-11-28e), added to the runs' data
# at CHAT_WEIGHT too, without the prompts whose first answer is held out. CHAT_MINUTES=0 with CHAT_WEIGHT set: no
# generation, the runs take the carried answers (/root/data/chat, and /root/data/chat-seedS when CHAT_SEED is set)
# TEXT_MINUTES (default 0: off): then, before the runs, the teacher's continuations of the openings of TEXT_FROM's
# training documents (default: DATA, the mix without chat; TEXT_FROM=unconditional: text the teacher writes from its
# start token alone, `generate-data --unconditional --temperature 1`), `generate-data --continue-from` on every run's GPU for
# that many minutes, into /root/data/teacher-text/ (back as teacher-text/ in runs.tgz); not added to DATA: a run
# takes it through its MORE_DATA entry in scripts/results.py (e.g. gdn-hybrid-text), so that it runs beside one without
# AFTER=/root/check/done END=<epoch seconds>: the runs (and the chat step) start once check_kernels.sh is done, each with the minutes
# left until END (the lease's end less the evaluation's return), in the background either way
source "$(dirname "$0")/prepare.sh"
cp scripts/results.py scripts/benchlib.py /root/  # the runs outlive this call and this copy of the repo

gpu_count() { local n; n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); echo $(( n > 0 ? n : 1 )); }
positive() { awk -v m="$1" 'BEGIN {exit !(m + 0 > 0)}'; }  # a number of minutes above 0 (CHAT_MINUTES=3.5)

start_runs() {  # the runs, one per GPU from 0, with --data $1; more runs than GPUs share them round-robin
  # (time-sliced: on one GPU, two runs each train at part of the rate, side by side on the same data).
  # GPUS_PER_RUN=P (default 1): each run trains on P GPUs under accelerate launch (results.py run --processes P)
  local data=$1 i=0 gpu name then minutes=${MINUTES:-20} ngpu per=${GPUS_PER_RUN:-1}
  ngpu=$(( $(gpu_count) / per ))  # the slots: groups of P GPUs
  [ $ngpu -ge 1 ] || { echo "$(date +%T) runs: GPUS_PER_RUN=$per but $(gpu_count) GPU(s)"; return 1; }
  shift
  # AFTER: a file to wait for (check_kernels.sh's /root/check/done: a GPU check beside the runs would slow
  # both); END (epoch seconds): each run then gets the whole minutes left until END
  if [ -n "${AFTER:-}" ]; then while [ ! -e "$AFTER" ]; do sleep 2; done; fi
  if [ -n "${END:-}" ]; then minutes=$(( (END - $(date +%s)) / 60 )); echo "$(date +%T) runs: $minutes minutes to END"; fi
  [ $# -le $ngpu ] || echo "$(date +%T) runs: $# runs on $ngpu GPU(s), sharing them"
  for name in "$@"; do
    # NAME@BASE: a branch, NAME's long-row stage on BASE's stages 1-2 (results.py run --from: it waits for
    # them, so it takes its GPU only once BASE's stage 2 is done)
    from=; [[ $name == *@* ]] && { from="--from ${name#*@}"; name=${name%@*}; }
    gpu=$(seq -s, $(( (i % ngpu) * per )) $(( (i % ngpu) * per + per - 1 ))); i=$((i + 1))  # e.g. 0 or 0,1
    # a run in the Qwen3.5 layout is then exported and its perplexity compared (results.py export); the
    # run's exit status goes to /root/runs/NAME.rc (watch_runs.sh stops once every run has one)
    rm -f /root/runs/$name.rc
    then=true; [[ $name == *qwen3_5 ]] && then="python3 results.py export $name --runs /root/runs"
    (cd /root && CUDA_VISIBLE_DEVICES=$gpu TORCH_LOGS=recompiles setsid nohup bash -c "python3 results.py run $name \
      --model /root/smollm2 --data '$data' --runs /root/runs --minutes $minutes --processes $per $from \
      ${EXTRA:+--extra='$EXTRA'} && $then; echo \$? > /root/runs/$name.rc" > /root/runs/$name.log 2>&1 < /dev/null &)
  done
}

gen_on_gpus() {  # NAME N DIR MINUTES ARGS...: generate-data (with ARGS) on GPUs 0..N-1, shard g/N, into
  # DIR/part-g.jsonl for MINUTES, once AFTER exists (generation beside a kernel check would time both); each GPU's
  # progress and any error in /root/runs/NAME-g.log; the files back with runs.tgz, in /root/runs/<DIR's name>/
  local name=$1 n=$2 dir=$3 minutes=$4 g rc pids=()
  shift 4
  [ "$n" -gt 0 ] || return 0
  mkdir -p $dir
  if [ -n "${AFTER:-}" ]; then while [ ! -e "$AFTER" ]; do sleep 2; done; fi
  echo "$(date +%T) $name: generate-data for $minutes minutes on GPUs 0-$((n - 1))"
  for ((g = 0; g < n; g++)); do
    CUDA_VISIBLE_DEVICES=$g python3 -m linearize.cli generate-data /root/smollm2 --out $dir/part-$g.jsonl \
      --shard $g/$n --max-minutes "$minutes" --batch-size ${CHAT_BATCH:-1024} --dtype bfloat16 "$@" 2> /root/runs/$name-$g.log &
    pids+=($!)
  done
  for ((g = 0; g < n; g++)); do
    wait ${pids[$g]} || { rc=$?; echo "$(date +%T) $name: generate-data on GPU $g failed (rc $rc), see /root/runs/$name-$g.log"; }
  done
  if [ -n "$(find $dir -name '*.jsonl' -size +0c 2>/dev/null)" ]; then
    mkdir -p /root/runs/$(basename $dir) && cp $dir/*.jsonl /root/runs/$(basename $dir)/
  fi
}

chat_then_runs() {  # generate-data on every run's GPU until CHAT_MINUTES, then the runs with the chat folder
  local gpus=$(( $# * ${GPUS_PER_RUN:-1} )) data=${DATA:-/root/data/Documentation} ngpu n
  ngpu=$(gpu_count); [ $gpus -le $ngpu ] || gpus=$ngpu  # one generate-data a GPU (the runs' GPUs)
  n=$gpus
  cd /root  # not a checkout: the installed package (scripts/device/README.md)
  local seed=${CHAT_SEED:-0} dir=/root/data/chat minutes=${CHAT_MINUTES:-0}
  [ "$seed" = 0 ] || dir=/root/data/chat-seed$seed
  mkdir -p $dir
  # CHAT_MINUTES=0 with CHAT_WEIGHT: no generation, the carried answers only (chat.tar.xz, chat-seedS.tar.xz)
  positive "$minutes" || n=0
  # the summary line goes to chat.log, each GPU's progress and any error to chat-$g.log
  gen_on_gpus chat $n $dir "$minutes" --samples 1000000 --seed $seed
  if [ $n -gt 0 ] && [ -n "$(find $dir -name '*.jsonl' -size +0c 2>/dev/null)" ]; then
    echo "$(date +%T) chat: $(cat $dir/*.jsonl | wc -l) samples, $(du -sh $dir | cut -f1)," \
      "$(grep -o '[0-9]* tokens at' /root/runs/chat.log | awk '{t += $1} END {print t + 0}') tokens generated"
  fi
  if [ -n "$(find /root/data/chat -name '*.jsonl' -size +0c 2>/dev/null)" ]; then
    data="$data,/root/data/chat@${CHAT_WEIGHT:-1}"
  else
    echo "$(date +%T) chat: no chat samples in /root/data/chat: the runs go without chat"
  fi
  if [ "$seed" != 0 ] && [ -n "$(find $dir -name '*.jsonl' -size +0c 2>/dev/null)" ]; then
    # a second answer to a prompt whose first answer is a held-out document would leak its prompt into
    # training: those are dropped (the first answers' split, by the hash of the rendered text, recipes/data.py)
    python3 - $dir /root/data/chat /root/data/chat-seed$seed-train <<'PY'
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
from linearize.recipes.data import DataConfig, _record_text, is_held_out
new, first, out = map(Path, sys.argv[1:])
tok = AutoTokenizer.from_pretrained("/root/smollm2")
percent = DataConfig().held_out_percent  # the runs' split (they keep the default)
held = {r["messages"][0]["content"] for f in first.glob("*.jsonl")
        for r in map(json.loads, f.read_text().splitlines()) if is_held_out(_record_text(r, tok), percent)}
out.mkdir(exist_ok=True)
kept = dropped = 0
for f in sorted(new.glob("*.jsonl")):
    lines = f.read_text().splitlines(keepends=True)
    keep = [line for line in lines if json.loads(line)["messages"][0]["content"] not in held]
    dropped += len(lines) - len(keep)
    kept += len(keep)
    (out / f.name).write_text("".join(keep))
print(f"chat: {new.name} answers kept {kept}, dropped {dropped} (their prompt's first answer is held out)")
PY
    data="$data,/root/data/chat-seed$seed-train@${CHAT_WEIGHT:-1}"
  fi
  if positive "${TEXT_MINUTES:-0}"; then
    local t=/root/data/teacher-text
    local from=(--continue-from "${TEXT_FROM:-${DATA:-/root/data/Documentation}}")
    [ "${TEXT_FROM:-}" != unconditional ] || from=(--unconditional --temperature 1)  # the teacher's own text
    gen_on_gpus text $gpus $t "$TEXT_MINUTES" --samples 10000000 "${from[@]}"
    echo "$(date +%T) text: $(cat $t/*.jsonl 2>/dev/null | wc -l) continuations, $(du -sh $t | cut -f1)"
  fi
  echo "$(date +%T) chat: starting the runs with --data $data"
  start_runs "$data" "$@"
}

if positive "${CHAT_MINUTES:-0}" || [ -n "$CHAT_WEIGHT" ] || positive "${TEXT_MINUTES:-0}"; then
  export -f gpu_count positive start_runs gen_on_gpus chat_then_runs
  export CHAT_MINUTES CHAT_SEED CHAT_BATCH CHAT_WEIGHT GPUS_PER_RUN TEXT_MINUTES TEXT_FROM DATA
  setsid nohup bash -c 'chat_then_runs "$@"' chat "$@" > /root/runs/chat.log 2>&1 < /dev/null &
elif [ -n "${AFTER:-}" ]; then  # the wait outlives this call
  export -f gpu_count start_runs
  setsid nohup bash -c 'start_runs "$@"' runs "${DATA:-/root/data/Documentation}" "$@" > /root/runs/launch.log 2>&1 < /dev/null &
else
  start_runs "${DATA:-/root/data/Documentation}" "$@"
fi
sleep 30; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
# GPU $gpu (the next free one), if any: the training benchmark on real packed documents beside random rows
if [ -n "$BENCH_GPU" ]; then
  mkdir -p /root/bench && cp -r scripts /root/bench/
  (cd /root/bench && CUDA_VISIBLE_DEVICES=$BENCH_GPU setsid nohup python3 scripts/bench_train.py --presets lolcats,gdn \
    --cuda-graphs --data /root/data/Documentation --tokenizer /root/smollm2 --json /root/runs/bench_train.json \
    --doc /root/runs/bench_train.md > /root/runs/bench_train.log 2>&1 < /dev/null &)
fi
