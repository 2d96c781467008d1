"""`write_atomically`: the old file or the new one, never a torn one, and nothing left behind."""

import pytest

from heterorl.files import write_atomically


def test_write_atomically_replaces_whole_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "sub" / "state.json"
    assert write_atomically(path, b"old") == path and path.read_bytes() == b"old"
    write_atomically(path, lambda f: f.write(b"new"), durable=False)
    assert path.read_bytes() == b"new"

    def torn(f):
        f.write(b"half")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError):
        write_atomically(path, torn)
    assert path.read_bytes() == b"new" and [p.name for p in path.parent.iterdir()] == ["state.json"]
