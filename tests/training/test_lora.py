"""LoRA training sessions: only the adapter trains and is saved; its exports (merged or alone) are what a worker
rebuilds from its own base; every mismatch is named."""

import pytest
import torch

from heterorl.config import LoraConfig
from heterorl.policies import load_policy
from heterorl.service.client import LocalService
from heterorl.training import lora
from heterorl.training.session import AdamParams, TrainingClient
from tests.service.test_sessions import _batch

BASE = "arith-hash-sft-base"


def _client(rank: int = 8, **kwargs) -> TrainingClient:
    return TrainingClient(*load_policy(BASE), seed=0, lora=LoraConfig(rank=rank, **kwargs))


def _train(client: TrainingClient, steps: int = 2) -> None:
    for step in range(steps):
        client.forward_backward(_batch(client.tokenizer, seed=step), loss_fn="gepo").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()


def test_only_the_adapter_trains_and_the_base_stays_as_it_was():
    client = _client()
    base = {name: t.clone() for name, t in load_policy(BASE)[0].state_dict().items()}
    trainable = sum(p.numel() for p in client.trainable_parameters())
    # rank 8 on the 7 projections of 4 layers of width 128 (MLP 512): 8 x (in + out) each
    assert trainable == 4 * 8 * (4 * 256 + 3 * 640)
    _train(client)
    assert len(client.optimizer.state) == len(client.trainable_parameters())  # Adam state for the adapter only
    _, whole = client.save_weights_for_sampler().result()
    assert set(whole) == set(base)
    for name, tensor in whole.items():
        adapted = any(f".{t}.weight" in name for t in LoraConfig().target_modules)
        assert torch.equal(tensor, base[name]) != adapted, name  # only the adapted weights moved


def test_a_worker_rebuilds_the_merged_weights_from_its_base_and_the_adapter_bit_for_bit():
    client = _client()
    _train(client)
    version, adapter = client.save_weights_for_sampler(form="adapter").result()
    _, whole = client.save_weights_for_sampler().result()
    assert version == 1 and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert adapter["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 128)
    worker_base = load_policy(BASE)[0]
    merger = lora.Merger(worker_base.state_dict(), lora.base_hash(worker_base))
    rebuilt = merger.merge(adapter, client.adapter_meta)
    assert set(rebuilt) == set(whole) and all(torch.equal(rebuilt[k], whole[k]) for k in whole)
    frozen = client.frozen_copy()  # a sampler's copy: a plain model, the adapter merged
    assert type(frozen).__name__ == "Qwen2ForCausalLM"
    assert all(torch.equal(frozen.state_dict()[k], whole[k]) for k in whole)
    # unmerged: adapter layers beside a worker's own model give the merged model's log-probs
    unmerged = lora.inject(load_policy(BASE)[0], client.lora)
    lora.load_adapter(unmerged, adapter)
    tokens = torch.tensor([_batch(client.tokenizer)[0].tokens])
    merged_logits = frozen(tokens).logits
    assert torch.allclose(unmerged(tokens).logits, merged_logits, atol=1e-5)


def test_a_saved_adapter_resumes_bit_for_bit_and_a_mismatched_one_is_refused_by_name(tmp_path):
    client = _client()
    _train(client, 1)
    client.save_state(tmp_path / "state").result()
    assert (tmp_path / "state").stat().st_size < 2 * 10**6  # the adapter and its Adam state, not the model
    _train(client, 1)
    _, expected = client.save_weights_for_sampler(form="adapter").result()
    again = _client()
    assert again.load_state(tmp_path / "state").result() == 0 and again.step == 1
    _train(again, 1)
    _, got = again.save_weights_for_sampler(form="adapter").result()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(lora.LoraError, match="rank 8 .saved. != 4"):
        _client(rank=4).load_state(tmp_path / "state").result()
    with pytest.raises(lora.LoraError, match="target_modules"):
        _client(target_modules=["q_proj"]).load_state(tmp_path / "state").result()
    with pytest.raises(lora.LoraError, match="holds a LoRA adapter, but the client trains the whole model"):
        TrainingClient(*load_policy(BASE)).load_state(tmp_path / "state").result()
    other_base = load_policy(BASE)[0]
    with torch.no_grad():
        other_base.model.norm.weight.add_(1e-3)  # another base: one tensor differs
    with pytest.raises(lora.LoraError, match="trained on another base"):
        TrainingClient(other_base, again.tokenizer, lora=LoraConfig(rank=8)).load_state(tmp_path / "state").result()


def test_a_rank_or_target_module_that_does_not_fit_is_refused_naming_it():
    with pytest.raises(lora.LoraError, match=r"'qkv_proj' is not a linear layer .*\['down_proj', 'gate_proj'"):
        _client(target_modules=["qkv_proj"])
    with pytest.raises(lora.LoraError, match="rank 200 exceeds .*smaller dimension .* give a rank <= 128"):
        _client(rank=200)
    with pytest.raises(Exception, match="form='adapter'. needs a LoRA client"):
        TrainingClient(*load_policy(BASE)).save_weights_for_sampler(form="adapter").result()


def test_an_adapter_of_another_base_is_refused_by_a_worker():
    client = _client()
    _, adapter = client.save_weights_for_sampler(form="adapter").result()
    other = load_policy("add3-sft-base")[0]
    merger = lora.Merger(other.state_dict(), lora.base_hash(other))
    with pytest.raises(lora.LoraError, match="belongs to base .* but this worker holds base .* learner's base"):
        merger.merge(adapter, client.adapter_meta)


def test_the_local_service_lists_base_models_and_makes_lora_and_full_sessions(tmp_path):
    from heterorl.policies import save_policy

    save_policy(*load_policy(BASE), tmp_path / "mine")
    service = LocalService({"my-arith": str(tmp_path / "mine")})
    names = service.list_base_models()
    assert {"add3-sft-base", "arith-hash-sft-base", "my-arith"} <= set(names)
    session = service.create_lora_training_client("my-arith", rank=4, seed=0)
    assert session.lora.rank == 4 and session.lora.alpha == 8.0  # alpha: 2 x rank by default
    assert session.adapter_meta["base"] == lora.base_hash(load_policy(BASE)[0])
    full = service.create_training_client("my-arith", seed=0)
    def count(client) -> int:
        return sum(p.numel() for p in client.trainable_parameters())

    assert full.lora is None and count(full) > 10 * count(session)
    with pytest.raises(Exception, match="NAME=PATH|does not exist"):
        LocalService({"x": str(tmp_path / "nowhere")})


def test_a_lora_rl_run_improves_held_out_success():
    """Synchronous RL with a rank-16 adapter from the shipped `####` base (the packaged arith_rl.yaml), 30 steps
    at lr 1e-3: at least 8 points over the base's 0.285 (`heterorl bench lora`: 0.430 after 40 steps, the whole
    model at lr 1e-4 0.461; docs/RESULTS.md "LoRA")."""
    from heterorl.config import load_config, packaged
    from heterorl.loops.sync_rl import run_sync_rl
    from heterorl.tasks import make_task_from

    cfg = load_config(packaged("arith_rl.yaml"),
                      ["rl.steps=30", "rl.eval_every=30", "task.options.eval_size=256", "lora.rank=16",
                       "optim.lr=1e-3"])
    training = TrainingClient(*load_policy(cfg.rl.base), seed=cfg.seed, lora=cfg.lora)
    result = run_sync_rl(cfg, training, make_task_from(cfg.task))
    assert result.final_success >= result.base_success + 0.08, result.history
