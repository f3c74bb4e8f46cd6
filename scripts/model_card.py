"""Render artifacts/models/<name>/README.md (the model card) from its training.json.

    python scripts/model_card.py artifacts/models/pystdlib-llama-12x256 [--sample-file F]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    d = Path(sys.argv[1])
    t = json.loads((d / "training.json").read_text())
    cfg = t["config"]
    size_mb = sum(p.stat().st_size for p in d.iterdir() if p.is_file()) / 1e6
    sample = ""
    if len(sys.argv) > 3 and sys.argv[2] == "--sample-file":
        sample = Path(sys.argv[3]).read_text()
    phases = t.get("phases") or [t]
    first, rest = phases[0], phases[1:]

    def phase_row(ph: dict) -> str:
        extra = []
        if ph.get("layerdrop_max"):
            extra.append(f"LayerSkip-style stochastic depth on every attention and MLP sublayer, drop probability "
                         f"rising linearly from 0 (layer 0) to {ph['layerdrop_max']} (last layer), no rescaling")
        if ph.get("exit_loss_weight"):
            extra.append(f"early-exit loss: one random intermediate layer per step through the final norm and LM head, "
                         f"weight {ph['exit_loss_weight']} x (l+1)/L")
        warm = ph.get("warmup", 100)
        return (f"{ph['steps']} steps x {ph['tokens_per_step']} tokens, peak lr {ph['lr']}, {warm} warm-up steps, "
                f"cosine to 10 %" + ("; " + "; ".join(extra) if extra else "") +
                f" ({ph['training_time_s']/60:.0f} min)" + (f"; {ph['note']}" if ph.get("note") else ""))

    training_rows = f"| training | {phase_row(first)}; AdamW (betas 0.9/0.95, weight decay 0.1), grad clip 1.0, bf16 autocast with fp32 master weights, seed {first['seed']} |\n"
    for i, ph in enumerate(rest, 2):
        training_rows += f"| training, phase {i} | continued from phase {i - 1}: {phase_row(ph)} |\n"
    total_min = sum(ph["training_time_s"] for ph in phases) / 60
    repro = f"python scripts/train_demo_model.py --out artifacts/models/{t['name']} --steps {first['steps']} --bf16\n"
    for ph in rest:
        repro += (f"python scripts/train_demo_model.py --init-from artifacts/models/{t['name']} --out artifacts/models/{t['name']} "
                  f"--steps {ph['steps']} --schedule-steps {ph.get('schedule_steps', ph['steps'])} --lr {ph['lr']} --warmup {ph.get('warmup', 100)} --layerdrop {ph.get('layerdrop_max', 0)} "
                  f"--exit-loss {ph.get('exit_loss_weight', 0)} --bf16" + "\n")
    prev_loss = "".join(f"; after phase {i}: {ph['held_out_loss_nats_per_token']}" for i, ph in enumerate(phases[:-1], 1)
                        if ph.get("held_out_loss_nats_per_token") is not None) if rest else ""
    card = f"""# {t['name']}

A small Llama-architecture causal LM that selfspec trains itself and ships, so that every
command runs offline on a fresh machine. It continues Python source code. It is a demo
and test model, not a general-purpose assistant.

| | |
|---|---|
| architecture | `LlamaForCausalLM`, {cfg['layers']} layers, hidden {cfg['hidden']}, MLP {cfg['intermediate']}, {cfg['heads']} query heads / {cfg['kv_heads']} KV heads (GQA), tied embeddings, RoPE theta 10000, context 1024 |
| parameters | {t['parameters']/1e6:.2f} M |
| weights | safetensors, float16 on disk ({size_mb:.1f} MB for the whole directory); selfspec loads them as float32 on CPU |
| tokenizer | byte-level BPE, vocabulary {cfg['vocab_size']} (`<|endoftext|>` = BOS = EOS = PAD), trained on the training corpus; no chat template |
| corpus | {t['corpus']}; Python {t['python_version']}; {t['train_files']} training files ({t['train_tokens']/1e6:.2f} M tokens), {t['held_out_files']} held-out files ({t['held_out_tokens']/1e6:.2f} M tokens) |
{training_rows}| training time | {total_min:.0f} min in all on {t['threads']} CPU threads (torch {t['torch']}) |
| held-out loss | **{t['held_out_loss_nats_per_token']} nats/token** on 256 fixed 512-token windows of the held-out test packages, measured on the saved float16 weights{prev_loss} |

Reproduce (seeded; the corpus depends on the local Python version):

```bash
{repro}python scripts/model_card.py artifacts/models/{t['name']}
```

Final training losses (step, loss): {t['train_loss_log'][-5:]}
"""
    if sample:
        card += f"\n## Greedy sample\n\n```python\n{sample}\n```\n"
    (d / "README.md").write_text(card)
    print(f"wrote {d / 'README.md'}")


if __name__ == "__main__":
    main()
