"""Greedy parity of selfspec on the default model against transformers' own GGUF loader.

The reference is ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (the GGUF
dequantized by transformers, not selfspec's cached conversion) decoding with
``generate(do_sample=False)``, chat template applied, turn by turn (a multi-turn
question's second turn sees the first answer). selfspec decodes the same questions with
each method through the same code path as ``selfspec generate``. Every turn's token ids
must be identical. Where one is not, the first differing token is reported with the reference
model's top-2 logit gap at that position (a near-tie in fp32 shows as a small gap).

    python scripts/gguf_parity.py --methods ar,self-sd,asd,swift,adadecode -n 64 \
        --suite spec-bench-mini [--target-precision auto] --output docs/bench/gguf-parity.json

``--model gemma3-270m``, ``qwen2.5-coder-1.5b`` (or a .gguf path) checks another GGUF model the same way; ``--no-chat-template``
feeds the questions as raw text (a base model such as Gemma 3 270M has no template: raw text either way).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from selfspec_cli import loading
from selfspec_cli.artifacts import environment_info, save_json_artifact
from selfspec_cli.bench.suite_loader import load_suite
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build
from selfspec_cli.runtime import encode_turn, eos_token_ids, run_prompt


def reference_turns(gguf: Path, prompts, n: int, chat_template: bool = True) -> tuple[dict, dict, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out, inputs = {}, {}
    for p in prompts:
        history, turns, ins = [], [], []
        for turn in p.turns:
            history.append({"role": "user", "content": turn})
            ids = encode_turn(tok, history, chat_template)
            ins.append(ids)
            x = torch.tensor([ids])
            with torch.no_grad():
                y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                   pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            turns.append(y)
            history.append({"role": "assistant", "content": tok.decode(y, skip_special_tokens=True)})
        out[p.id], inputs[p.id] = turns, ins
        print(f"reference {p.id}: {[len(t) for t in turns]} tokens", file=sys.stderr, flush=True)
    return out, inputs, model


def first_difference(model, inputs: list[list[int]], ref: list[list[int]], got: list[list[int]]) -> dict:
    """The first turn and token where ``got`` leaves ``ref``, with the reference model's two best
    logits there (their gap: how near a tie the fp32 model itself was)."""
    for t, (r, g) in enumerate(zip(ref, got)):
        if r == g:
            continue
        i = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
        with torch.no_grad():
            logits = model(torch.tensor([inputs[t] + r[:i]])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        return {"turn": t, "token": i, "reference": r[i] if i < len(r) else None, "got": g[i] if i < len(g) else None,
                "top2_logit_gap": round(float(top.values[0] - top.values[1]), 6)}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="ar,self-sd,asd,swift,adadecode")
    ap.add_argument("--suite", default="spec-bench-mini")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--target-precision", default="auto")
    ap.add_argument("--model", default=None, help="the default model, gemma3-270m, or a .gguf file")
    ap.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    ap.add_argument("--limit", type=int, default=None, help="the suite's first N prompts")
    args = ap.parse_args()
    prompts = load_suite(args.suite)
    if args.limit:
        prompts = prompts[:args.limit]
    t0 = time.perf_counter()
    gguf = (loading.default_model_gguf() if args.model in (None, "smollm2") else
            loading.gemma_model_gguf() if args.model == loading.GEMMA_MODEL_NAME else
            loading.chunked_model_gguf(loading.CHUNKED_MODELS[args.model]) if args.model in loading.CHUNKED_MODELS else
            Path(args.model))
    ref, inputs, ref_model = reference_turns(gguf, prompts, args.max_new_tokens, args.chat_template)
    ref_s = time.perf_counter() - t0
    model, tok = loading.load_model(args.model, dtype="float32", device="cpu", lite=True)  # as generate loads it
    engine = Engine(model, target_precision=args.target_precision)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(model, tok))
    results = {}
    for name in args.methods.split(","):
        meth = build(name, engine, tok)
        same, differing, t1 = 0, [], time.perf_counter()
        for p in prompts:
            rec = run_prompt(meth.generate, tok, p, cfg, torch.device("cpu"), name, args.chat_template)
            got = [t.token_ids for t in rec.all_turns()]
            if got == ref[p.id]:
                same += 1
            else:
                differing.append({"id": p.id, **first_difference(ref_model, inputs[p.id], ref[p.id], got)})
        results[name] = {"identical": same, "questions": len(prompts), "differing": differing,
                         "seconds": round(time.perf_counter() - t1, 1)}
        print(f"{name}: {same}/{len(prompts)} questions token-identical to transformers' GGUF model", file=sys.stderr, flush=True)
    doc = {"model": str(gguf.name), "chat_template": bool(args.chat_template and getattr(tok, "chat_template", None)),
           "suite": args.suite, "max_new_tokens": args.max_new_tokens, "turns": sum(len(p.turns) for p in prompts),
           "target_precision": engine.target_precision,
           "reference": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=...).generate(do_sample=False)",
           "reference_seconds": round(ref_s, 1), "methods": results, "environment": environment_info("cpu", torch.float32)}
    if args.output:
        save_json_artifact(args.output, doc)
    print(json.dumps({k: v["identical"] for k, v in results.items()}))
    return 0 if all(r["identical"] == r["questions"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
