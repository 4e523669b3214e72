"""Converted checkpoints travel: push through the real huggingface_hub client to a local fake Hub
on loopback, remote code where linearize cannot be imported, pipelines."""

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

import linearize
from linearize.hub import PushError, model_card, push_to_hub

from conftest import converted


class FakeHub(BaseHTTPRequestHandler):
    """The endpoints huggingface_hub calls for create_repo, create_branch and create_commit."""

    state: dict = {}

    def log_message(self, *args):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        st = self.state
        st.setdefault("calls", []).append(self.path)
        if self.headers.get("Authorization") != "Bearer hf_test" and self.path != "/api/validate-yaml":
            return self._json(401, {"error": "Invalid credentials"})
        if self.path == "/api/repos/create":
            payload = json.loads(body)
            repo = f"{payload['organization']}/{payload['name']}"
            if payload["organization"] == "someone-else":
                return self._json(403, {"error": "You don't have the rights to create a model under this namespace"})
            st.setdefault("repos", {})[repo] = payload
            return self._json(200, {"url": f"http://{self.headers['Host']}/{repo}"})
        if self.path == "/api/validate-yaml":
            content = json.loads(body)["content"]
            st["validated_card"] = content
            ok = content.startswith("---\n") and "license:" in content
            return self._json(200 if ok else 400, {"errors": [] if ok else [{"message": "bad"}], "warnings": []})
        if "/branch/" in self.path:
            st.setdefault("branches", []).append(self.path.rsplit("/", 1)[-1])
            return self._json(200, {})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        if "/commit/" in self.path:
            if st.get("conflict"):
                return self._json(409, {"error": "A commit has happened since. Please refresh and try again."})
            lines = [json.loads(l) for l in body.decode().splitlines() if l.strip()]
            header = lines[0]["value"]
            files = {l["value"]["path"]: base64.b64decode(l["value"]["content"]) for l in lines[1:] if l["key"] == "file"}
            st.setdefault("commits", []).append({"path": self.path, "message": header["summary"], "files": files})
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            return self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/abc123",
                                    "commitOid": "abc123", "pullRequestUrl": None})
        return self._json(404, {"error": f"no route {self.path}"})


@pytest.fixture
def hub():
    FakeHub.state = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeHub.state
    server.shutdown()


def tiny_tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>")


@pytest.fixture
def checkpoint(tmp_path):
    model = converted("llama", linearize.LinearAttentionConfig(feature_map="t2r", window=3, layers=[0, 2]))
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "eval.json").write_text(json.dumps({"tokens": 100, "perplexity": 5.0, "teacher_perplexity": 4.0,
                                                             "top1_agreement": 0.9}))
    return tmp_path / "ckpt", model


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_push_uploads_one_commit_with_card(hub, checkpoint, monkeypatch):
    endpoint, state = hub
    folder, _ = checkpoint
    (folder / "pytorch_model.bin").write_bytes(b"pickle")  # must never travel
    before = snapshot(folder)
    url = push_to_hub(folder, "me/tiny-linear", token="hf_test", endpoint=endpoint, revision="v1", license="mit")
    assert url == f"{endpoint}/me/tiny-linear/commit/abc123"
    assert state["repos"]["me/tiny-linear"]["visibility"] == "public"
    assert state["branches"] == ["v1"]
    (commit,) = state["commits"]
    assert commit["path"].endswith("/api/models/me/tiny-linear/commit/v1")
    assert commit["message"].startswith("Upload linearized model")
    files = commit["files"]
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
            "modeling_linearize.py", "layers.py", "attention.py", "cache.py"} <= set(files)
    assert "pytorch_model.bin" not in files and "eval.json" not in files
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert "license: mit" in card and "t2r feature-map linear attention" in card
    assert "| perplexity | 5.000 | 4.000 |" in card and "trust_remote_code=True` runs the Python files" in card
    assert snapshot(folder) == before  # nothing local changed


def test_push_cli(hub, checkpoint, monkeypatch, capsys):
    from linearize.cli import main

    endpoint, state = hub
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert main(["push", str(checkpoint[0]), "me/x", "--endpoint", endpoint, "--private"]) == 0
    assert state["repos"]["me/x"]["visibility"] == "private"
    assert "pushed" in capsys.readouterr().out


def test_push_errors_are_clear_and_change_nothing(hub, checkpoint, monkeypatch, tmp_path):
    endpoint, state = hub
    folder, _ = checkpoint
    before = snapshot(folder)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(PushError, match="no Hugging Face token"):
        push_to_hub(folder, "me/x", endpoint=endpoint)
    with pytest.raises(PushError, match="no write access to someone-else/x"):
        push_to_hub(folder, "someone-else/x", token="hf_test", endpoint=endpoint)
    state["conflict"] = True
    with pytest.raises(PushError, match="changed or conflicts"):
        push_to_hub(folder, "me/x", token="hf_test", endpoint=endpoint)
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # no backoff waits
    with pytest.raises(PushError, match="could not reach"):
        push_to_hub(folder, "me/x", token="hf_test", endpoint="http://127.0.0.1:9")  # nothing listens there
    assert "commits" not in state
    assert snapshot(folder) == before
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(PushError, match="not a converted checkpoint"):
        push_to_hub(plain, "me/x", token="hf_test", endpoint=endpoint)


def test_card_names_the_embedded_base_model_and_its_license(tmp_path):
    model = converted("llama")
    model.config.linearize["base_model"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(tmp_path)
    # the tokens of every stage that ran (stage 3: the long rows), and of nothing else the run recorded
    (tmp_path / "distill.json").write_text(json.dumps({
        "config": {"preset": "gdn-hybrid"}, "data": {"data": "docs"}, "budget": {"tokens": 7},
        "stage1": {"tokens": 1000}, "stage2": {"tokens": 20000}, "stage3": {"tokens": 300}}))
    card = model_card(tmp_path, "me/m")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "license: apache-2.0" in card
    assert "- training tokens: 21,300; data: `docs`" in card and "recipe: `gdn-hybrid`" in card


REMOTE = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "linearize" or name.startswith("linearize."):
                raise ImportError("linearize is not installed here")
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    try:
        import linearize
        raise SystemExit("linearize importable")
    except ImportError:
        pass
    folder, ref = sys.argv[1], torch.load(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "transformers_modules" in type(model).__module__, type(model).__module__
    with torch.no_grad():
        assert torch.equal(model(ref["ids"]).logits, ref["logits"]), "logits differ"
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    pipe = pipeline("text-generation", model=folder, trust_remote_code=True)
    pipe.tokenizer.padding_side = "left"
    out = pipe(["w5 w6 w7 w8", "w9 w10"], do_sample=False, max_new_tokens=5, batch_size=2, pad_token_id=0,
               return_full_text=False)
    assert [o[0]["generated_text"] for o in out] == ref["texts"], (out, ref["texts"])
    print("REMOTE-OK")
    """
)


def test_remote_code_without_linearize_installed(checkpoint, tmp_path):
    folder, model = checkpoint
    tok = tiny_tokenizer()
    ids = torch.randint(2, 97, (1, 9))
    with torch.no_grad():
        logits = model(ids).logits
    texts = []
    for prompt in ["w5 w6 w7 w8", "w9 w10"]:
        x = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(x, do_sample=False, max_new_tokens=5, pad_token_id=0)
        texts.append(tok.decode(out[0, x.shape[1]:], skip_special_tokens=True))
    torch.save({"ids": ids, "logits": logits, "texts": texts}, tmp_path / "ref.pt")
    script = tmp_path / "remote.py"
    script.write_text(REMOTE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # a fresh modules cache
    # the same thread count as this process (one per worker under pytest -n): the logits compare exactly
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    res = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path / "ref.pt")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert "REMOTE-OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_pipeline_loads_from_a_folder_with_the_package(checkpoint):
    folder, model = checkpoint
    pipe = pipeline("text-generation", model=str(folder))
    assert type(pipe.model).__name__ == "LinearizedLlamaForCausalLM"
    pipe.tokenizer.padding_side = "left"
    out = pipe(["w5 w6 w7 w8", "w9 w10"], do_sample=False, max_new_tokens=5, batch_size=2, pad_token_id=0, return_full_text=False)
    tok = tiny_tokenizer()
    for prompt, o in zip(["w5 w6 w7 w8", "w9 w10"], out):
        x = tok(prompt, return_tensors="pt").input_ids
        alone = model.generate(x, do_sample=False, max_new_tokens=5, pad_token_id=0)
        assert o[0]["generated_text"] == tok.decode(alone[0, x.shape[1]:], skip_special_tokens=True)
