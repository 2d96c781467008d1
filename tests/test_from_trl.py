"""The path in from the Hugging Face / TRL world, end to end and without a workaround: a policy folder saved with
`save_pretrained` (a Qwen2 model + a `tokenizers` char tokenizer whose post-processor adds a BOS), a JSONL with its
own column names and its own eval file, a token-level reward, TRL's names (dapo, a linear schedule), one
`heterorl rl` command. Its step-0 eval equals a direct greedy evaluation of the saved folder with transformers."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tests.conftest import run_cli
from tests.training.test_prompts import char_tokenizer

PROBLEMS = [(a, b) for a in range(10) for b in range(10)]


def _trl_style_folder(folder):
    """A small Qwen2 trained (plain torch, as any trainer would) on '<bos>a+b=' -> 'c<eos>' for 60 steps: a
    partial policy (~0.35), so its step-0 score is not a trivial 0 or 1."""
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=32))
    rng, optimizer = random.Random(0), torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        rows = []
        for a, b in (rng.choice(PROBLEMS) for _ in range(64)):
            rows.append(tokenizer(f"{a}+{b}=").input_ids + tokenizer(str(a + b), add_special_tokens=False).input_ids
                        + [tokenizer.eos_token_id])
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        labels = ids.clone()
        labels[ids == 0], labels[:, :5] = -100, -100  # padding and the prompt '<bos>a+b='
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _greedy_success_with_transformers(folder, rows) -> float:
    """The digits, then EOS, by the saved folder alone (its own tokenizer class, BOS and all)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    solved = 0
    for row in rows:
        ids = torch.tensor([tokenizer(row["question"]).input_ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        want = tokenizer(row["solution"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        solved += out[:len(want)] == want
    return solved / len(rows)


@pytest.mark.slow
def test_a_trl_style_folder_dataset_and_reward_run_with_no_workaround(tmp_path):
    folder = tmp_path / "trl-model"
    _trl_style_folder(folder)
    rows = [{"question": f"{a}+{b}=", "solution": str(a + b), "source": "add1"} for a, b in PROBLEMS]
    held = rows[::5]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r not in held))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    (tmp_path / "run.yaml").write_text(f"""
seed: 0
task:
  name: jsonl
  options: {{path: {tmp_path / 'train.jsonl'}, eval_path: {tmp_path / 'eval.jsonl'}, prompt_column: question,
            answer_column: solution}}
  reward_fn: tests.token_reward:digits_then_eos
rollout: {{group_size: 4, max_tokens: 4}}
loss: {{name: dapo}}
optim: {{lr: 1.0e-3, schedule: linear, min_lr_ratio: 0.0}}
rl: {{base: {folder}, steps: 3, prompts_per_step: 8, eval_every: 3}}
logging: {{run_dir: {tmp_path / 'run'}, wandb_mode: disabled, progress: false}}
""")
    out = run_cli("rl", "--config", str(tmp_path / "run.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "solves none" not in out.stderr
    history = json.loads((tmp_path / "run" / "summary.json").read_text())["history"]
    direct = _greedy_success_with_transformers(folder, held)
    assert 0.05 < direct < 0.95  # a partial policy: the comparison can tell BOS from no BOS
    assert history[0]["eval/success"] == pytest.approx(direct), (history, direct)
    assert [h["step"] for h in history] == [0, 3]
