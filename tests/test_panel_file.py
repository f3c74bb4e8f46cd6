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


def test_writer_streams_each_tensor_and_reads_back(tmp_path):
    """A tensor handed to the Writer is on disk at once: the caller may drop it (the block copy's build holds one
    matrix at a time); the header written last still names every tensor."""
    from selfspec_cli.paths import atomic_open

    path = tmp_path / "s.panels"
    want = {}
    with atomic_open(path) as f:
        out = panel_file.Writer(f)
        for i in range(5):
            t = torch.full((i + 1, 64), i, dtype=torch.uint8)
            want[f"m{i}"] = t.clone()
            out.add(f"m{i}", t)
            assert f.tell() % 64 == 0 and f.tell() >= 64 * (i + 2)  # written now, not at the end
            del t
        with pytest.raises(ValueError, match="twice"):
            out.add("m0", torch.zeros(1, dtype=torch.uint8))
        out.finish({"k": 1})
    got, meta = panel_file.load(path)
    assert meta == {"k": 1} and all(torch.equal(got[k], v) for k, v in want.items())


def test_first_layout_still_read(tmp_path):
    """A file of the first layout (SSPANEL1: the header first) loads as before."""
    import json
    import struct

    t = torch.arange(16, dtype=torch.int32)
    header = json.dumps({"metadata": {"a": 2}, "tensors": {"t": {"dtype": "int32", "shape": [16], "offset": 128,
                                                                  "nbytes": 64}}}).encode()
    blob = panel_file.MAGIC_V1 + struct.pack("<Q", len(header)) + header
    path = tmp_path / "v1.panels"
    path.write_bytes(blob + b"\0" * (128 - len(blob)) + t.numpy().tobytes())
    got, meta = panel_file.load(path)
    assert meta == {"a": 2} and torch.equal(got["t"], t)
