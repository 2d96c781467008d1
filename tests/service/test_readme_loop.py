"""The documented remote GRPO loop (docs/SERVICE.md), taken from the page as it is and run against
`heterorl serve` in its own process on loopback: it must learn (held-out greedy success rises, fixed seeds)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from heterorl.bench.service import start_service

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- the remote GRPO loop -->"


def readme_loop() -> str:
    """The python block that follows the marker in docs/SERVICE.md."""
    text = (ROOT / "docs" / "SERVICE.md").read_text()
    assert MARKER in text, f"docs/SERVICE.md lost its {MARKER!r} block"
    found = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert found, "no ```python block after the marker in docs/SERVICE.md"
    return found.group(1)


@pytest.fixture
def served(tmp_path):
    """`heterorl serve --bind 127.0.0.1:0` with a key; yields (url, key)."""
    key = "readme-loop-key"
    (tmp_path / "key.txt").write_text(key + "\n")
    (tmp_path / "state").mkdir()
    proc, url = start_service("--api-key-file", str(tmp_path / "key.txt"), "--threads", "1",
                              state_dir=str(tmp_path / "state"))
    try:
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
    exec(compile(readme_loop(), "docs/SERVICE.md (the remote GRPO loop)", "exec"), scope)
    scope["service"].close()
    before, after = scope["before"], scope["after"]
    print(capsys.readouterr().out)
    # measured here: BEFORE -> AFTER (seed 0); the margin leaves room for other torch builds' rounding
    assert after >= before + 0.08, f"held-out success {before:.3f} -> {after:.3f}: the remote loop did not learn"
    assert os.environ["HETERORL_URL"].startswith("http://127.0.0.1:")
