"""The README's GRPO loop, taken from the README as it is and run against `heterorl serve` in its own process on
loopback: it must learn (held-out greedy success rises, fixed seeds)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- the remote GRPO loop -->"


def readme_loop() -> str:
    """The python block that follows the marker in the README."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md lost its {MARKER!r} block"
    found = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert found, "no ```python block after the marker"
    return found.group(1)


@pytest.fixture
def served(tmp_path):
    """`heterorl serve --bind 127.0.0.1:0` with a key; yields (url, key)."""
    key = "readme-loop-key"
    (tmp_path / "key.txt").write_text(key + "\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "serve", "--bind", "127.0.0.1:0",
                                 "--api-key-file", str(tmp_path / "key.txt"), "--state-dir", str(tmp_path / "state"),
                                 "--threads", "1", "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and proc.poll() is None and time.monotonic() < deadline:
            found = re.search(r"serving training sessions on (http://\S+)", log.read_text())
            url = found.group(1) if found else time.sleep(0.1)
        assert url, f"heterorl serve did not start:\n{log.read_text()}"
        yield url, key
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_readme_grpo_loop_learns_against_a_served_learner(served, monkeypatch, capsys):
    url, key = served
    monkeypatch.setenv("HETERORL_URL", url)
    monkeypatch.setenv("HETERORL_API_KEY", key)
    scope: dict = {"__name__": "readme_loop"}
    exec(compile(readme_loop(), "README.md (the remote GRPO loop)", "exec"), scope)
    scope["service"].close()
    before, after = scope["before"], scope["after"]
    print(capsys.readouterr().out)
    # measured here: BEFORE -> AFTER (seed 0); the margin leaves room for other torch builds' rounding
    assert after >= before + 0.08, f"held-out success {before:.3f} -> {after:.3f}: the remote loop did not learn"
    assert os.environ["HETERORL_URL"].startswith("http://127.0.0.1:")
