"""SWIFT with and without a cap on its verification tree, side by side with ar (one run).

    python scripts/swift_tree_budget.py [MAX_NEW_TOKENS]   # example prompts, default 128 tokens

Contenders are interleaved prompt by prompt with a rotating order; every SWIFT output is
checked against ar's. Prints tok/s, speedup over ar and M per variant.
"""
import sys, time
from dataclasses import replace
from selfspec_cli.loading import load_model
from selfspec_cli.engine import Engine
from selfspec_cli.config import GenerationConfig
from selfspec_cli.prompts import read_prompts
from selfspec_cli.methods import AR
from selfspec_cli.methods.swift import Swift, SwiftConfig
n_tok = int(sys.argv[1]) if len(sys.argv) > 1 else 128
model, tok = load_model(device="cpu"); eng = Engine(model)
cfg = GenerationConfig(max_new_tokens=n_tok, eos_token_ids=(model.generation_config.eos_token_id,))
ids = [tok(p.turns[0])["input_ids"] for p in read_prompts("examples/prompts.jsonl")]
base = SwiftConfig()
variants = {"ar": None, "paper": base.draft, "nodes8": replace(base.draft, tree_max_nodes=8),
            "nodes4": replace(base.draft, tree_max_nodes=4), "chain": replace(base.draft, tree=False)}
meths = {k: (AR(eng, tok) if v is None else Swift(eng, tok, config=replace(base, draft=v))) for k, v in variants.items()}
for m in meths.values():
    m.generate(ids[0], cfg)
tt = {k: 0.0 for k in meths}; nt = {k: 0 for k in meths}; acc = {k: [] for k in meths}; outs = {}
names = list(meths)
for i, p in enumerate(ids):
    order = names[i % len(names):] + names[:i % len(names)]
    for k in order:
        t0 = time.perf_counter(); r = meths[k].generate(p, cfg); dt = time.perf_counter() - t0
        tt[k] += dt; nt[k] += len(r.token_ids); acc[k] += r.stats.accept_lengths
        outs[(k, i)] = r.token_ids
    for k in names:  # parity: every variant's output equals ar's
        assert outs[(k, i)] == outs[("ar", i)], (k, i)

for k in names:
    print(k, f"{nt[k]/tt[k]:.1f} tok/s", f"{(nt[k]/tt[k])/(nt['ar']/tt['ar']):.3f}x", f"M {sum(acc[k])/len(acc[k]):.2f}")
