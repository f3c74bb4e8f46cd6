"""PNG plots of a bench run (matplotlib, headless Agg backend, written atomically)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..paths import atomic_write

if TYPE_CHECKING:
    from ..methods.base import SearchPoint
    from .report import MethodSummary


def pyplot():
    """matplotlib's pyplot on the headless Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically, and close it. Stored with a 256-colour
    palette (:func:`palette_png`): a plot's few flat colours survive it, at about 40 % of the
    bytes of matplotlib's RGBA file (the bench runs the docs cite are kept in the repository)."""
    import io

    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
        return atomic_write(path, lambda f: palette_png(buf.getvalue(), f))
    finally:
        pyplot().close(fig)


def palette_png(png: bytes, out: Any) -> None:
    """Re-encode the PNG bytes ``png`` with a 256-colour palette (Pillow, matplotlib's own
    dependency), optimized, into the binary file ``out``."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)


def speedup_by_category(summary: Mapping[str, MethodSummary], path: Path, reference: str = "ar",
                        title: str = "") -> Path | None:
    """Grouped bars: speedup over the reference per category (and overall) for each method."""
    names = [n for n, m in summary.items() if n != reference and m.overall.speedup_vs_ar is not None]
    if not names:
        return None
    cats = sorted({c for n in names for c in summary[n].categories})
    groups = ["all", *cats]
    width = 0.8 / len(names)
    fig, ax = pyplot().subplots(figsize=(max(6.0, 1.4 * len(groups) * max(1, len(names)) / 3), 4.2))
    for i, n in enumerate(names):
        m = summary[n]
        vals = [m.overall.speedup_vs_ar] + [(b.speedup_vs_ar if (b := m.categories.get(c)) else None) or 0.0 for c in cats]
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        label = n if m.lossless else f"{n} (lossy)"
        bars = ax.bar(xs, vals, width, label=label, hatch=None if m.lossless else "//")
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=7, padding=1)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set(ylabel=f"speedup over {reference} (ratio of mean tokens/s)",
           title=title or f"Speedup by category and method (1.0 = {reference})")
    ax.legend(fontsize=8, ncols=min(4, len(names)))
    return save_figure(fig, path)


def swift_heatmap(history: Sequence[SearchPoint], num_layers: int, path: Path, title: str = "") -> Path | None:
    """SWIFT's layer search: which sublayers each evaluated candidate skips (light) and the
    best set so far (dark) at every optimization step, with matchness on top."""
    if not history:
        return None
    import numpy as np

    cand, best = np.zeros((2, 2 * num_layers, len(history)))
    scores, best_scores = [h.score for h in history], []
    cur_best: tuple[list[int], list[int]] | None = None
    for j, h in enumerate(history):
        attn, mlp = h.skip
        if h.best or cur_best is None:
            cur_best, cur_score = (attn, mlp), h.score
        cand[[*attn, *(num_layers + l for l in mlp)], j] = 1  # rows: attention 0..L-1, then MLP
        best[[*cur_best[0], *(num_layers + l for l in cur_best[1])], j] = 1
        best_scores.append(cur_score)
    fig, (ax0, ax1) = pyplot().subplots(2, 1, figsize=(max(6.0, min(14.0, len(history) / 25)), 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 3]})
    ax0.plot(scores, ".", ms=2, color="tab:gray", label="candidate")
    ax0.plot(best_scores, "-", color="tab:red", label="best so far")
    ax0.set(ylabel="matchness", title=title or "SWIFT: skipped sublayers over optimization steps")
    ax0.legend(fontsize=7, loc="lower right")
    ax1.imshow(0.35 * cand + 0.65 * best, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1)
    ticks = list(range(0, num_layers, max(1, num_layers // 8)))
    ax1.set_yticks(ticks + [num_layers + t for t in ticks],
                   [f"attn {t}" for t in ticks] + [f"mlp {t}" for t in ticks], fontsize=7)
    ax1.axhline(num_layers - 0.5, color="tab:blue", lw=0.8)
    ax1.set(xlabel="optimization step", ylabel="skipped sublayer (dark: best set, light: candidate)")
    return save_figure(fig, path)


def accept_length_histogram(logs: Mapping[str, Sequence[int]], path: Path, title: str = "") -> Path | None:
    """Share of target forwards that added 1, 2, ... tokens, one panel per method."""
    logs = {n: v for n, v in logs.items() if v}
    if not logs:
        return None
    n = len(logs)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(4.0 * cols, 2.8 * rows), squeeze=False)
    top = max(max(v) for v in logs.values())
    for ax, (name, lengths) in zip(axes.flat, logs.items()):
        counts, total = Counter(lengths), len(lengths)
        ax.bar(range(1, top + 1), [counts[k] / total for k in range(1, top + 1)], color="tab:blue")
        ax.set_title(f"{name}: M = {sum(lengths) / total:.2f}", fontsize=9)
        ax.set_xlabel("tokens per target forward", fontsize=8)
        ax.set_ylabel("share of forwards", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title or "Accepted length per target forward")
    fig.tight_layout()
    return save_figure(fig, path)
