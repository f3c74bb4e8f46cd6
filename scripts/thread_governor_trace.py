"""ar on examples/questions.jsonl x 64 tokens with the --threads auto governor, tallying the forwards
at each thread count and every switch (forward index, from, to, that forward in ms); ONE=1: one
thread, no governor. Run: PYTHONPATH=. python scripts/thread_governor_trace.py (docs/engine.md, "Threads")."""
import os, sys, json, time, collections
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
import torch
from selfspec_cli.engine import threads as T
if os.environ.get("ONE"):
    torch.set_num_threads(1)
else:
    T.AUTO["threads"] = 2
    torch.set_num_threads(2)
tally = collections.Counter(); sw = []
orig = T.ThreadGovernor.observe
def observe(self, rows, seconds):
    tally[(self.current, rows == 1)] += 1
    before = self.current
    orig(self, rows, seconds)
    if self.current != before: sw.append((sum(tally.values()), before, self.current, round(seconds * 1e3, 1)))
T.ThreadGovernor.observe = observe
from selfspec_cli.loading import load_model
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build
from selfspec_cli.config import GenerationConfig
mdl, tok = load_model(None)
eng = Engine(mdl)
m = build("ar", eng, tok)
qs = [json.loads(l) for l in open(os.path.join(os.path.dirname(__file__), "..", "examples", "questions.jsonl"))]
t0 = time.perf_counter(); n = 0
for q in qs:
    text = q.get("prompt") or q["turns"][0]
    from selfspec_cli.runtime import encode_turn
    ids = encode_turn(tok, [{"role": "user", "content": text}], True)
    n += len(m.generate(list(ids), GenerationConfig(max_new_tokens=64)).token_ids)
print("tok/s", round(n / (time.perf_counter() - t0), 1), dict(tally), "switches", sw[:12])
