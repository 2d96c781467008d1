import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402

MAZE_ALPHABET = ".#SG\n>UDLR"


@pytest.fixture(scope="session")
def tiny_policy():
    """A small random tiny policy over the maze alphabet (shared; do not train it in place)."""
    from heterorl.policies import TinyModelConfig, build_tiny_policy

    return build_tiny_policy(MAZE_ALPHABET + "0123456789+=# ", TinyModelConfig(hidden_size=64, num_layers=2,
                                                                               intermediate_size=128, seed=1))
