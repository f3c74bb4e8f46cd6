"""The packed-panel cache's file (engine/panel_file.py): tensors round-trip bit for bit, 64-byte aligned, without a
copy (they alias the mapping); a partial or foreign file is refused (the caller rebuilds)."""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.engine import panel_file


def test_round_trip_aligned_and_mapped(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.codes": torch.randint(0, 255, (3, 17, 64), generator=g, dtype=torch.uint8),
               "a.scales": torch.randn(3, 5, 64, generator=g).to(torch.float16),
               "b": torch.randn(7, generator=g).to(torch.bfloat16), "c": torch.randn(2, 3, generator=g),
               "empty": torch.zeros(0, dtype=torch.int8)}
    path = tmp_path / "p.panels"
    panel_file.save(path, tensors, {"formats": "x", "n": 3})
    got, meta = panel_file.load(path)
    assert meta == {"formats": "x", "n": 3} and list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert got[name].data_ptr() % 64 == 0 or t.numel() == 0
    got["c"].add_(1)  # copy-on-write: the file is untouched
    assert torch.equal(panel_file.load(path)[0]["c"], tensors["c"])


def test_partial_or_foreign_file_is_refused(tmp_path):
    path = tmp_path / "p.panels"
    panel_file.save(path, {"x": torch.arange(1000, dtype=torch.int32)}, {})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="outside the file"):
        panel_file.load(path)
    path.write_bytes(b"not a panel file at all")
    with pytest.raises(ValueError, match="not a selfspec panel file"):
        panel_file.load(path)
