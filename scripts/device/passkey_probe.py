"""Passkey by length on a saved run: generated (as `linearize eval`), generated with the window hybrids'
linear branch zeroed, and teacher-forced (every key token the argmax after the prompt: no decode path).
PYTHONPATH=/tmp/site python3 scripts/device/passkey_probe.py RUN_DIR 3072,4096,5120,8192 TRIALS [BATCHES]
BATCHES (e.g. 8,1): also the generated passkey at these prompts a `generate` call (left-padded batches).
A probe of 2026-11-30k (lolcats-hybrid retrieved 15% at 4K, 67% at 8K): it leaves main once answered."""
import random, sys, time, torch
from linearize.loading import load_model_and_tokenizer
from recipes.evaluate import passkey_accuracy, passkey_prompt, window_layers, window_only

m, t = load_model_and_tokenizer(sys.argv[1], None, None)  # the saved dtype, as `linearize eval`
DEV = "cuda" if torch.cuda.is_available() else "cpu"
m = m.to(DEV).eval()
trials = int(sys.argv[3])
batches = [int(b) for b in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
for L in [int(x) for x in sys.argv[2].split(",")]:
    t0 = time.time()
    full = passkey_accuracy(m, t, lengths=(L,), trials=trials, device=DEV)[str(L)]
    win = None
    if window_layers(m):
        with window_only(m):
            win = passkey_accuracy(m, t, lengths=(L,), trials=trials, device=DEV)[str(L)]
    rng, hits = random.Random(L), 0  # evaluate's seed 0: random.Random(0 * 1000 + L), the same prompts
    with torch.no_grad():
        for _ in range(trials):
            ids, key = passkey_prompt(t, L, rng)
            kid = t(" " + key, add_special_tokens=False).input_ids
            x = torch.tensor([ids + kid], device=DEV)
            pred = m(x, use_cache=False).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
            hits += pred == kid
    by_batch = {b: passkey_accuracy(m, t, lengths=(L,), trials=trials, device=DEV, batch_size=b)[str(L)] for b in batches}
    print(f"{sys.argv[1]} L={L} generated={full:.2f} by_batch={by_batch} window_only={win} teacher_forced={hits / trials:.2f} "
          f"({time.time() - t0:.0f}s)", flush=True)
