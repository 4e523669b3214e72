"""lm-evaluation-harness's HF backend runs on a converted checkpoint, on a task defined locally."""

import json

import torch

import linearize

from conftest import converted
from test_hub import tiny_tokenizer

TASK = """task: linearize_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_hf_backend_on_a_local_task(tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = converted("llama", linearize.LinearAttentionConfig(feature_map="t2r", window=3))
    tok = tiny_tokenizer()
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    docs = [{"query": f"w{5 + i} w{6 + i} w{7 + i}", "choices": [f"w{8 + i}", f"w{20 + i}", f"w{40 + i}"], "gold": i % 3}
            for i in range(12)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))

    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'ckpt'},trust_remote_code=True", tasks=["linearize_local"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")), device="cpu", batch_size=1,
    )
    acc = res["results"]["linearize_local"]["acc,none"]

    # the same accuracy from the model's own log-likelihoods of each choice
    hits = 0
    for d in docs:
        ctx = tok(d["query"]).input_ids
        scores = []
        for choice in d["choices"]:
            cont = tok(" " + choice).input_ids
            with torch.no_grad():
                logp = model(torch.tensor([ctx + cont]), use_cache=False).logits.log_softmax(-1)[0]
            scores.append(sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)))
        hits += int(max(range(3), key=scores.__getitem__) == d["gold"])
    assert acc == hits / len(docs)
