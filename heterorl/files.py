"""Files that are whole or absent: `write_atomically`, used for every checkpoint, state and summary the project
writes (a leaf: it imports nothing else of heterorl)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomically(path: str | Path, data: bytes | Callable[[BinaryIO], None], durable: bool = True) -> Path:
    """Write ``data`` (bytes, or a function that writes to the open file) to a temporary file beside ``path``
    and rename it over ``path``: a killed process leaves the old file or the new one, never a torn one. With
    ``durable``, the file is flushed to disk before the rename and the folder after it, so a machine that loses
    power keeps one of the two as well."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(path.parent)
    return path


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
