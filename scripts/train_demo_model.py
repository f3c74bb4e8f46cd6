"""Train selfspec's shipped demo model: a small Llama on the CPython standard library.

Why this model: every selfspec command must run offline on a fresh machine, and
layer skipping needs a model that is deep enough (12+ layers) and good enough that
its greedy continuations are predictable. The corpus is the one text every machine
with Python has: the standard library's own source. Its ``test`` packages
(``test/``, ``tests/``, ``idle_test/``) are held out for evaluation.

Reproduce (seeded; the corpus depends on the Python version, recorded in the card)::

    python scripts/train_demo_model.py --out artifacts/models/pystdlib-llama-12x256

Phases:
  1) corpus: every ``*.py`` under ``sysconfig.get_paths()['stdlib']`` except
     site-packages, sorted by path; split into train / held-out (test packages).
  2) tokenizer: byte-level BPE trained on the train split (``tokenizers``).
  3) model: ``LlamaForCausalLM`` trained with AdamW + cosine schedule on random
     512-token windows of the concatenated stream (files joined by EOS).
  4) evaluation: held-out loss (nats/token) on fixed windows of the test packages,
     measured on the *saved* (fp16-rounded) weights, and a greedy sample.
Checkpoints are written atomically every ``--save-every`` steps so an interrupted
run still leaves a usable model.

Continued training (``--init-from DIR``) reuses DIR's tokenizer and weights and
appends a phase to its training card. Two LayerSkip-style options (Elhoushi et al.,
2024) make the model tolerate the layer skipping that self-speculative drafting does:

* ``--layerdrop P``: per-sample stochastic depth on every attention and MLP sublayer
  separately (the sublayers selfspec skips), with drop probability rising linearly
  from 0 at layer 0 (never dropped) to P at the last layer; no rescaling, so the full
  model at inference is the model that was trained.
* ``--exit-loss W``: each step, the cross-entropy of one uniformly chosen intermediate
  layer read through the shared final norm and LM head (the logit lens), weighted by
  W * (l + 1) / L, added to the final-layer loss.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

HELD_OUT_DIRS = {"test", "tests", "idle_test"}
EOS = "<|endoftext|>"


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        (held if HELD_OUT_DIRS.intersection(rel.parts[:-1]) else train).append(p)
    return train, held


def read_texts(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.model_max_length = 1024
    fast.save_pretrained(out)
    return fast


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    eos = tok.eos_token_id
    for t in texts:
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def atomic_save(model, tok, out: Path, card: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    model.to(torch.float16).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    tok.save_pretrained(tmp)
    (tmp / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


class LayerDrop:
    """Per-sample stochastic depth on each attention and MLP sublayer, via forward hooks."""

    def __init__(self, model, p_max: float):
        layers = model.model.layers
        L = len(layers)
        self.p = [0.0] + [p_max * i / (L - 1) for i in range(1, L)]
        self.masks: dict[tuple[int, str], torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(layers):
            if self.p[i] <= 0:
                continue
            self.handles.append(layer.self_attn.register_forward_hook(self._hook(i, "attn")))
            self.handles.append(layer.mlp.register_forward_hook(self._hook(i, "mlp")))

    def _hook(self, i: int, kind: str):
        def hook(module, inputs, output):
            m = self.masks.get((i, kind))
            if m is None or not module.training:
                return output
            if isinstance(output, tuple):
                return (output[0] * m.to(output[0].dtype),) + tuple(output[1:])
            return output * m.to(output.dtype)
        return hook

    def resample(self, batch: int, g: torch.Generator) -> None:
        self.masks = {}
        for i, p in enumerate(self.p):
            if p <= 0:
                continue
            for kind in ("attn", "mlp"):
                self.masks[(i, kind)] = (torch.rand(batch, 1, 1, generator=g) >= p).float()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.masks = {}


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, n_windows: int, batch: int) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(stream) - seq_len - 1, (n_windows,), generator=g)
    tot, n = 0.0, 0
    for i in range(0, n_windows, batch):
        s = starts[i : i + batch]
        x = torch.stack([stream[j : j + seq_len + 1].long() for j in s.tolist()])
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("artifacts/models/pystdlib-llama-12x256"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fast on CPUs with AMX)")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--time-steps", type=int, default=0, help="only time this many steps and exit")
    ap.add_argument("--schedule-steps", type=int, default=0,
                    help="length of the cosine schedule (default --steps); larger stops the run part-way down it")
    ap.add_argument("--init-from", type=Path, default=None, help="continue training this model directory")
    ap.add_argument("--layerdrop", type=float, default=0.0, help="max per-sublayer drop probability (last layer)")
    ap.add_argument("--exit-loss", type=float, default=0.0, help="weight of one random intermediate layer's loss")
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    # 1) corpus
    train_paths, held_paths = stdlib_files()
    train_texts, held_texts = read_texts(train_paths), read_texts(held_paths)
    print(f"corpus: {len(train_texts)} train files ({sum(map(len, train_texts))/1e6:.1f} MB), "
          f"{len(held_texts)} held-out files", file=sys.stderr)

    # 2) tokenizer
    tok_dir = args.out.with_name(args.out.name + ".tokenizer")
    if args.init_from is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.init_from)
    else:
        tok = train_tokenizer(train_texts, args.vocab_size, tok_dir)
    train_stream = encode_stream(tok, train_texts)
    held_stream = encode_stream(tok, held_texts)
    print(f"tokens: train {len(train_stream)/1e6:.2f}M, held-out {len(held_stream)/1e6:.2f}M "
          f"({sum(map(len, train_texts))/len(train_stream):.2f} chars/token)", file=sys.stderr)

    # 3) model
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        initializer_range=0.02,
    )
    previous_phases: list = []
    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        prev = json.loads((args.init_from / "training.json").read_text())
        previous_phases = prev.pop("phases", None) or [prev]
        args.layers, args.hidden = model.config.num_hidden_layers, model.config.hidden_size
        args.intermediate, args.heads = model.config.intermediate_size, model.config.num_attention_heads
        args.kv_heads, args.vocab_size = model.config.num_key_value_heads, model.config.vocab_size
    else:
        model = LlamaForCausalLM(cfg)
    drop = LayerDrop(model, args.layerdrop) if args.layerdrop > 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params/1e6:.2f}M parameters", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, (args.schedule_steps or args.steps) - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    g = torch.Generator().manual_seed(args.seed)
    L = model.config.num_hidden_layers
    model.train()
    log = []
    t0 = time.time()
    print(f"setup took {t0 - t_start:.0f}s", file=sys.stderr)

    def card(step: int, held: float | None) -> dict:
        phase = {
            "name": args.out.name, "architecture": "LlamaForCausalLM", "parameters": n_params,
            "config": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab_size")},
            "corpus": "CPython standard library *.py (site-packages excluded); test/tests/idle_test held out",
            "python_version": platform.python_version(), "train_files": len(train_texts), "held_out_files": len(held_texts),
            "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
            "steps": step, "tokens_per_step": args.batch * args.seq_len, "lr": args.lr, "seed": args.seed,
            "bf16_autocast": args.bf16, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "training_time_s": round(time.time() - t_start, 1), "held_out_loss_nats_per_token": held,
            "train_loss_log": log[-50:],
            "init_from": str(args.init_from) if args.init_from else None,
            "schedule_steps": args.schedule_steps or args.steps, "layerdrop_max": args.layerdrop, "exit_loss_weight": args.exit_loss, "warmup": args.warmup,
        }
        if not previous_phases:
            return phase
        return {**phase, "phases": previous_phases + [phase],
                "steps_total": sum(p["steps"] for p in previous_phases) + step,
                "training_time_s_total": round(sum(p["training_time_s"] for p in previous_phases) + phase["training_time_s"], 1)}

    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch,), generator=g)
        x = torch.stack([train_stream[s : s + args.seq_len + 1].long() for s in starts.tolist()])
        if drop is not None:
            drop.resample(args.batch, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = model(input_ids=x[:, :-1], output_hidden_states=args.exit_loss > 0)
            logits = out.logits
            exit_logits = None
            if args.exit_loss > 0:
                layer = int(torch.randint(1, L - 1, (1,), generator=g))
                exit_logits = model.lm_head(model.model.norm(out.hidden_states[layer + 1]))
        targets = x[:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets)
        if exit_logits is not None:
            exit_ce = torch.nn.functional.cross_entropy(exit_logits.float().reshape(-1, exit_logits.shape[-1]), targets)
            total = loss + args.exit_loss * (layer + 1) / L * exit_ce
        else:
            total = loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1 or step + 1 == args.time_steps:
            el = time.time() - t0
            print(f"step {step} loss {loss.item():.3f} lr {lr_at(step):.2e} {el/(step+1):.2f}s/step elapsed {el/60:.1f}m",
                  file=sys.stderr, flush=True)
            log.append([step, round(loss.item(), 4)])
        if args.time_steps and step + 1 >= args.time_steps:
            return
        if (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            atomic_save(model, tok, args.out, card(step + 1, None))

    # 4) evaluation on the saved (fp16-rounded) weights
    if drop is not None:
        drop.remove()
    atomic_save(model, tok, args.out, card(args.steps, None))
    saved = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    held = held_out_loss(saved, held_stream, args.seq_len, 256, 8)
    print(f"held-out loss {held:.3f} nats/token", file=sys.stderr)
    final = card(args.steps, round(held, 4))
    (args.out / "training.json").write_text(json.dumps(final, indent=2) + "\n")
    shutil.rmtree(tok_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
