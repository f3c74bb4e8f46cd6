"""Write examples/calibration.jsonl: calibration prompts cut from the demo model's
*training* corpus (CPython stdlib, test packages excluded), deterministic, disjoint
from the example and benchmark prompts so that no search is tuned on them.

    python scripts/make_calibration_prompts.py [--n 64] [--out examples/calibration.jsonl]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import stdlib_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("examples/calibration.jsonl"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    train, _ = stdlib_files()
    out = []
    for path in rng.sample(train, len(train)):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class ")) and i + 6 < len(lines)]
        if not defs:
            continue
        i = rng.choice(defs)
        block = "\n".join(lines[i : i + rng.randint(3, 6)])
        cut = block.rstrip()
        cut = cut[: max(len(cut) - rng.randint(1, 12), 8)].rstrip()  # end mid-line, never on whitespace
        if len(cut) < 20:
            continue
        out.append({"id": f"cal-{len(out) + 1}", "source": path.name, "prompt": cut})
        if len(out) == args.n:
            break
    args.out.write_text("".join(json.dumps(o) + "\n" for o in out))
    print(f"wrote {len(out)} prompts to {args.out}")


if __name__ == "__main__":
    main()
