"""The tiny policy: char-level tokenizer and a folder that round-trips through from_pretrained."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from heterorl.errors import PolicyLoadError, SamplingError
from heterorl.policies import TinyModelConfig, build_tiny_policy, load_policy, save_policy
from heterorl.rollout.textcodec import encode_text

ALPHABET = "0123456789+=#\n .SGUDLR>"


def test_tokenizer_is_char_level_with_specials_first():
    _, tok = build_tiny_policy(ALPHABET, TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert len(tok) == 2 + len(set(ALPHABET))
    text = "123+45=\n#.S G\nUDLR"
    ids = encode_text(tok, text)
    assert len(ids) == len(text)  # one token per character, digits never merged
    assert tok.decode(ids) == text


def test_folder_round_trips_through_auto_classes(tmp_path):
    # AutoTokenizer forces Qwen2's tokenizer class on a qwen2 folder; the saved tokenizer must survive that:
    # same ids for digits, spaces and newlines, and the same model outputs.
    model, tok = build_tiny_policy(ALPHABET, TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    save_policy(model, tok, tmp_path / "p")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "p", local_files_only=True)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path / "p", local_files_only=True)
    text = "907+13=#### 920\n S.#\nG..\n>RRD"
    assert tok2(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok2.decode(tok2(text)["input_ids"]) == text
    assert (tok2.pad_token_id, tok2.eos_token_id) == (0, 1)
    ids = torch.tensor([encode_text(tok, text)])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, model2(ids).logits, atol=1e-6)
    loaded, _ = load_policy(str(tmp_path / "p"))
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())


def test_save_replaces_folder_without_leftovers(tmp_path):
    model, tok = build_tiny_policy(ALPHABET, TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    save_policy(model, tok, tmp_path / "p")
    save_policy(model, tok, tmp_path / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_same_seed_same_weights():
    cfg = TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64, seed=3)
    a, _ = build_tiny_policy(ALPHABET, cfg)
    b, _ = build_tiny_policy(ALPHABET, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_text_outside_alphabet_is_an_error():
    _, tok = build_tiny_policy("SG.#", TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    with pytest.raises(SamplingError, match="cannot represent"):
        encode_text(tok, "S.x")
    with pytest.raises(SamplingError, match="empty"):
        encode_text(tok, "")


def test_bad_shapes_and_alphabets_are_errors():
    with pytest.raises(PolicyLoadError, match="num_heads"):
        build_tiny_policy("ab", TinyModelConfig(hidden_size=30, num_heads=4))
    with pytest.raises(PolicyLoadError, match="ASCII"):
        build_tiny_policy("aé", TinyModelConfig(hidden_size=32, num_layers=1))
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy("/nonexistent/policy-folder")
