"""Decode-only throughput of a bench run, beside the end-to-end figure the bench reports.

End-to-end tokens/s counts each turn's prefill; at 64 new tokens on an 800-token prompt the
prefill is a large share of the time. Decode-only = (new tokens - 1 per turn, the prefill's
token) / (draft + verify seconds), from the records' per-turn stats (selfspec methods only;
HF peers do not report them).

    python scripts/decode_only.py docs/bench/smollm2-quant-1t
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    out_dir = Path(sys.argv[1])
    ref_cat: dict[str, float] = {}
    rows = {}
    for f in sorted((out_dir / "records").glob("*.jsonl")):
        per_cat: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for line in f.read_text().splitlines():
            r = json.loads(line)
            turns = r.get("turns") or [r]
            sts = [t.get("stats", {}) for t in turns]
            if not all("verify_s" in st for st in sts):
                break
            toks = sum(t["new_tokens"] - 1 for t in turns)
            secs = sum(st["draft_s"] + st["verify_s"] for st in sts)
            e2e = r["new_tokens"] / r["wall_time_s"]
            per_cat[r.get("category", "all")].append((toks / secs, e2e))
        if not per_cat:
            continue
        name = f.stem
        allv = [v for vs in per_cat.values() for v in vs]
        rows[name] = {"decode_only_tok_s": statistics.fmean(d for d, _ in allv),
                      "end_to_end_tok_s": statistics.fmean(e for _, e in allv),
                      "by_category_decode_only": {c: statistics.fmean(d for d, _ in vs) for c, vs in per_cat.items()}}
    ref = rows.get("ar")
    for name, row in rows.items():
        if ref:
            row["decode_only_vs_ar"] = row["decode_only_tok_s"] / ref["decode_only_tok_s"]
            row["by_category_decode_only_vs_ar"] = {c: v / ref["by_category_decode_only"][c]
                                                    for c, v in row["by_category_decode_only"].items()}
        print(f"{name:10s} end-to-end {row['end_to_end_tok_s']:6.1f} tok/s, decode-only {row['decode_only_tok_s']:6.1f} tok/s"
              + (f" ({row['decode_only_vs_ar']:.2f}x ar; " + ", ".join(f"{c} {v:.2f}" for c, v in row["by_category_decode_only_vs_ar"].items()) + ")" if ref else ""))
    (out_dir / "decode_only.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
