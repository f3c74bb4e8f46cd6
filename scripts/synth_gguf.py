"""A GGUF file of a real model's exact shape, with random blocks: for speed measurements where the real file
cannot travel (a lent machine that takes 64 MiB a call; docs/benchmarks.md, "Many cores").

Two steps:

    python scripts/synth_gguf.py header REAL.gguf OUT_STEM      # writes OUT_STEM.head and OUT_STEM.json
    python scripts/synth_gguf.py fill OUT_STEM SYNTH.gguf [--seed 0]

`header` keeps the file's header bytes as they are (metadata: config, tokenizer, chat template; every tensor's
name, type, shape and offset) and lists the tensors. `fill` writes the same header followed by every tensor's
bytes at its offset: random codes, with each block's float16 scales set so that weights are about 0.02 in size
and centred on zero (so no activation overflows or turns subnormal over the layers, which would change the
speed), norms at 1 and other float32 tensors small and random.

What it keeps and what it does not: every matrix has the real file's type, shape and byte count, so a forward
reads the same bytes and runs the same instructions as on the real model, and the tokens are meaningless
(random weights). Speed figures from such a file are labelled as such; the real file's figures on this
machine are the check that the two agree (docs/benchmarks.md). Only the block types of the files we measure
are filled; another type is refused in one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

_D = 8e-5  # a K-quant super-block's d: weights of about 0.02 for codes near 8 and group factors of 16-32


def _f16(v: float) -> bytes:
    return np.float16(v).tobytes()


def _fill_blocks(kind: str, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    raw = np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).copy()
    if kind == "Q4_K":  # d, dmin, scales[12], qs[128]
        b = raw.reshape(-1, 144)
        b[:, 0:2] = np.frombuffer(_f16(_D), np.uint8)
        b[:, 2:4] = np.frombuffer(_f16(_D * 7.5), np.uint8)  # sc = m in every group: dmin m = 7.5 d sc
        b[:, 4:12] = 0x20  # sc, m of groups 0-3: 32
        b[:, 12:16] = 0xFF  # groups 4-7: 15
    elif kind == "Q6_K":  # ql[128], qh[64], scales[16] int8, d
        b = raw.reshape(-1, 210)
        b[:, 192:208] = 16
        b[:, 208:210] = np.frombuffer(_f16(_D), np.uint8)  # d * 16 * (q - 32): about 0.02
    elif kind == "Q4_1":  # d, m, qs[16]
        b = raw.reshape(-1, 20)
        b[:, 0:2] = np.frombuffer(_f16(0.003), np.uint8)
        b[:, 2:4] = np.frombuffer(_f16(-0.003 * 7.5), np.uint8)
    elif kind == "Q4_0":  # d, qs[16]
        b = raw.reshape(-1, 18)
        b[:, 0:2] = np.frombuffer(_f16(0.003), np.uint8)
    elif kind == "Q8_0":  # d, qs[32]
        b = raw.reshape(-1, 34)
        b[:, 0:2] = np.frombuffer(_f16(0.0003), np.uint8)
    else:
        raise SystemExit(f"synth_gguf: block type {kind} is not filled by this script; add its layout here")
    return raw


def header(real: Path, stem: Path) -> None:
    from gguf import GGUFReader

    r = GGUFReader(real)
    head = real.open("rb").read(r.data_offset)
    tensors = [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
               for t in r.tensors]
    size = real.stat().st_size
    stem.with_suffix(".head").write_bytes(head)
    stem.with_suffix(".json").write_text(json.dumps({"source": real.name, "size": size, "tensors": tensors}))
    print(f"{stem}.head: {len(head)} bytes; {len(tensors)} tensors; the file is {size} bytes", file=sys.stderr)


def fill(stem: Path, out: Path, seed: int) -> None:
    info = json.loads(stem.with_suffix(".json").read_text())
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(stem.with_suffix(".head").read_bytes())
        for t in sorted(info["tensors"], key=lambda t: t["offset"]):
            f.seek(t["offset"])
            if t["type"] == "F32":
                n = t["nbytes"] // 4
                v = np.ones(n, np.float32) if "norm" in t["name"] else (rng.standard_normal(n) * 0.02).astype(np.float32)
                f.write(v.tobytes())
            else:
                f.write(_fill_blocks(t["type"], t["nbytes"], rng).tobytes())
        f.truncate(info["size"])
    tmp.replace(out)
    print(f"{out}: {info['size']} bytes, the shape of {info['source']} with random blocks (seed {seed})", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("header")
    h.add_argument("real", type=Path)
    h.add_argument("stem", type=Path)
    f = sub.add_parser("fill")
    f.add_argument("stem", type=Path)
    f.add_argument("out", type=Path)
    f.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.cmd == "header":
        header(a.real, a.stem)
    else:
        fill(a.stem, a.out, a.seed)


if __name__ == "__main__":
    main()
