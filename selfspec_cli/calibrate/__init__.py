"""Offline calibration: searches whose result is saved as an artifact and loaded later.

* :mod:`.self_sd`: Self-SD's skipped-sublayer set, by Bayesian optimization of
  measured throughput (``selfspec calibrate --method self-sd``);
* :mod:`.specee`: SpecEE's offline predictor schedule from exit-frequency statistics
  (``selfspec calibrate --method specee``);
* :mod:`.fr_spec`: FR-Spec's frequency-ranked draft vocabulary and its size
  (``selfspec calibrate --method fr-spec``);
* :mod:`.data`: calibration prompts from a prompt file or a local dataset.

No typer or rich here; the CLI passes progress callbacks.
"""
from __future__ import annotations

CALIBRATE_METHODS = ("self-sd", "specee", "fr-spec")
