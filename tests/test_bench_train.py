"""scripts/bench_train.py --smoke: every row runs the recipes' step on CPU and the page shows it;
a 2-process record gets a scaling column against the 1-process one."""

import json

from conftest import load_script


def test_smoke_measures_every_row_and_writes_the_page(tmp_path):
    bench = load_script("bench_train")
    out_json, doc = tmp_path / "t.json", tmp_path / "t.md"
    record = bench.main(["--smoke", "--json", str(out_json), "--doc", str(doc)])
    names = list(record["rows"])
    assert names == ["plain softmax", "lolcats stage 1 (attention transfer)", "lolcats stage 2 (KD, LoRA)",
                     "gdn stage 1 (attention transfer)", "gdn stage 2 (KD, full fine-tune)"]
    for name, row in record["rows"].items():
        assert row["tok_per_s"] > 0 and row["loss"] > 0, name
    assert record["rows"]["lolcats stage 2 (KD, LoRA)"]["kd_loss"] == "chunked"
    assert record["rows"]["gdn stage 2 (KD, full fine-tune)"]["trainable"] > record["rows"]["lolcats stage 2 (KD, LoRA)"]["trainable"]
    page = doc.read_text()
    assert "| lolcats stage 2 (KD, LoRA) |" in page and "| plain softmax | " in page and "100% |" in page

    # a 2-process record beside it: scaling = its tokens/s over the 1-process figure
    data = json.loads(out_json.read_text())
    two = json.loads(json.dumps(data["1"]))
    two["processes"] = 2
    for row in two["rows"].values():
        row["tok_per_s"] *= 1.9
    data["2"] = two
    page = bench.render(data)
    assert "## 2 processes" in page and page.count(" 1.90x |") == 5
