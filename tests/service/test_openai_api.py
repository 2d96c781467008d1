"""The OpenAI-compatible endpoint over real HTTP on loopback, driven by the official ``openai`` client: what it
answers is what the sampling client itself samples, with the engine's behaviour log-probs."""

import threading

import httpx
import openai
import pytest
from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from heterorl.cli import main
from heterorl.config import TinyModelConfig
from heterorl.engines.base import SampleOutput, SamplingParams
from heterorl.engines.torch_engine import TorchEngine
from heterorl.policies import build_tiny_policy, load_policy
from heterorl.runtime.worker import RolloutWorker, WorkerOptions
from heterorl.service.openai_api import openai_app
from heterorl.service.openai_generation import finish
from heterorl.service.server import ServerThread
from heterorl.training.session import SamplingClient

PROMPT = "123+456="  # the shipped add3 policy answers 579, then its end-of-sequence token
# a user message's content, then "=" to open the assistant's turn: "123+456" becomes PROMPT
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


class GatedEngine(TorchEngine):
    """A torch engine whose generations wait until ``gate`` is set (``entered``: one is waiting)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.gate = threading.Event(), threading.Event()

    def generate(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().generate(*args, **kwargs)


@pytest.fixture(scope="module")
def add3_policy():
    model, tokenizer = load_policy("add3-sft-base")
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


@pytest.fixture(scope="module")
def served(add3_policy):
    model, tokenizer = add3_policy
    tiny_model, tiny_tokenizer = build_tiny_policy("0123456789+=", TinyModelConfig(
        hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2, num_kv_heads=2, seed=3))
    clients = {"add3": SamplingClient.for_model(model, tokenizer, version=3),
               "tiny": SamplingClient.for_model(tiny_model, tiny_tokenizer, version=0),  # no chat template
               "gated": SamplingClient(GatedEngine(tiny_model, tiny_tokenizer), tiny_tokenizer, version=1)}
    yield clients
    clients["gated"].engine.gate.set()
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def server(served):
    with ServerThread(openai_app(lambda: served, owned_by="tests")) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def own_sample(client: SamplingClient, prompt: str, **params):
    ids = client.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids, client.sample(ids, 1, SamplingParams(**params)).result()[0]


def test_models_lists_the_served_ids(api, served):
    listed = api.models.list().data
    assert sorted(m.id for m in listed) == sorted(served)
    assert {(m.object, m.owned_by) for m in listed} == {("model", "tests")}
    assert api.models.retrieve("add3").id == "add3"


def test_greedy_completion_is_the_samplers_own_greedy_sample(api, served):
    _, own = own_sample(served["add3"], PROMPT, max_tokens=8, temperature=0)
    out = api.completions.create(model="add3", prompt=PROMPT, n=2, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "add3"
    assert [c.text for c in out.choices] == [own.text, own.text] == ["579", "579"]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop"]  # the end-of-sequence token
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (8, 8, 16)
    assert out.system_fingerprint == "heterorl-v3"

    cut = api.completions.create(model="add3", prompt=PROMPT, max_tokens=2, temperature=0)
    assert (cut.choices[0].text, cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("57", "length", 2)


def test_each_model_id_samples_its_own_client(api, served):
    _, own = own_sample(served["tiny"], PROMPT, max_tokens=6, temperature=0)
    out = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.choices[0].text == own.text


def test_prompts_as_token_ids_and_lists(api, served):
    ids = served["add3"].tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert api.completions.create(model="add3", prompt=ids, max_tokens=5, temperature=0).choices[0].text == "579"
    out = api.completions.create(model="add3", prompt=[PROMPT, "111+222="], n=2, max_tokens=5, temperature=0)
    assert [c.text for c in out.choices] == ["579", "579", "333", "333"]  # prompt-major, as OpenAI orders them
    assert out.usage.prompt_tokens == 16
    out = api.completions.create(model="add3", prompt=[ids, ids[:4]], max_tokens=5, temperature=0)
    assert out.choices[0].text == "579" and len(out.choices) == 2


def test_stop_strings_cut_the_text(api):
    one_token = api.completions.create(model="add3", prompt=PROMPT, max_tokens=8, temperature=0, stop="7",
                                       logprobs=0)
    choice = one_token.choices[0]
    assert (choice.text, choice.finish_reason) == ("5", "stop")
    assert choice.logprobs.tokens == ["5", "7"]  # through the token that completed the stop string
    assert choice.logprobs.top_logprobs is None  # logprobs=0
    two_tokens = api.completions.create(model="add3", prompt=PROMPT, max_tokens=8, temperature=0, stop=["x", "79"],
                                        logprobs=1)
    choice = two_tokens.choices[0]
    assert (choice.text, choice.finish_reason, two_tokens.usage.completion_tokens) == ("5", "stop", 3)
    assert choice.logprobs.tokens == ["5", "7", "9"] and choice.logprobs.text_offset == [0, 1, 2]


def test_logprobs_are_the_engines_behaviour_logprobs(api, served):
    prompt_ids, own = own_sample(served["add3"], PROMPT, max_tokens=6, temperature=1.7, top_p=0.95, seed=11)
    out = api.completions.create(model="add3", prompt=PROMPT, max_tokens=6, temperature=1.7, top_p=0.95, seed=11,
                                 logprobs=1)
    logprobs = out.choices[0].logprobs
    tokenizer = served["add3"].tokenizer
    assert logprobs.tokens == [tokenizer.decode([t]) for t in own.tokens]
    assert logprobs.token_logprobs == pytest.approx(own.logprobs, abs=1e-6)
    assert logprobs.top_logprobs == [{t: lp} for t, lp in zip(logprobs.tokens, logprobs.token_logprobs)]
    assert logprobs.text_offset == list(range(len(own.tokens)))  # one character per token

    greedy = api.completions.create(model="add3", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True})
    logprobs = greedy.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    assert tokens[-1] == tokenizer.eos_token_id and logprobs.tokens[0].startswith("token_id:")
    # greedy: the model's own log-probs (temperature 1), as teacher forcing computes them
    teacher = served["add3"].compute_logprobs(prompt_ids + tokens).result()[len(prompt_ids) - 1:]
    assert logprobs.token_logprobs == pytest.approx(teacher, abs=1e-5)


def test_a_character_split_over_byte_tokens_comes_out_whole():
    """A byte-level tokenizer without merges: "é" is two tokens, neither of them text on its own."""
    tokenizer = Qwen2Tokenizer(vocab={"<eos>": 0} | {c: i + 1 for i, c in enumerate(bytes_to_unicode().values())},
                               merges=[], eos_token="<eos>", unk_token="<eos>")
    tokens = tokenizer.encode("né!", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(tokens) == 5
    sample = SampleOutput(tokens=tokens, logprobs=[-0.5] * 5, stop_reason="eos")
    whole = finish(tokenizer, [], sample, [], token_ids=False)
    assert (whole.text, whole.finish_reason) == ("né!", "stop")
    assert whole.shares == ["n", "", "é", "!", ""] and whole.text_offsets == [0, 1, 1, 2, 3]
    cut = finish(tokenizer, [], sample, ["!"], token_ids=False)
    assert (cut.text, cut.tokens, cut.shares) == ("né", tokens[:4], ["n", "", "é", ""])


def test_chat_completion_renders_the_chat_template(api):
    out = api.chat.completions.create(model="add3", messages=[{"role": "user", "content": "123+456"}],
                                      temperature=0, logprobs=True, top_logprobs=2, n=2, max_completion_tokens=8)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert [(c.message.role, c.message.content, c.finish_reason) for c in out.choices] == [
        ("assistant", "579", "stop")] * 2
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["5", "7", "9", "<eos>"]
    assert [t.top_logprobs[0].token for t in content] == ["5", "7", "9", "<eos>"]
    assert content[0].bytes == [ord("5")] and all(len(t.top_logprobs) == 1 for t in content)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (8, 8)

    cut = api.chat.completions.create(model="add3", messages=[{"role": "user", "content": [
        {"type": "text", "text": "123+456"}]}], temperature=0, stop=["9"], max_tokens=8)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason, cut.choices[0].logprobs) == (
        "57", "stop", None)


def test_chat_without_a_chat_template_is_refused_naming_it(api):
    with pytest.raises(openai.BadRequestError, match="model 'tiny' has no chat template"):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2"}])


def test_streams_carry_the_text_of_the_answer(api):
    plain = api.completions.create(model="add3", prompt=PROMPT, max_tokens=8, temperature=0, stop="9")
    chunks = list(api.completions.create(model="add3", prompt=PROMPT, max_tokens=8, temperature=0, stop="9",
                                         stream=True, logprobs=1, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text == "57"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == [
        "5", "7", "9"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 3

    messages = [{"role": "user", "content": "123+456"}]
    plain = api.chat.completions.create(model="add3", messages=messages, temperature=0, max_tokens=8)
    chunks = list(api.chat.completions.create(model="add3", messages=messages, temperature=0, max_tokens=8,
                                              stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content == "579"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_refusals_name_what_is_wrong(api):
    with pytest.raises(openai.NotFoundError, match=r"model 'gpt-4' is not served here; served: add3, gated, tiny"):
        api.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="n: Input should be greater than or equal to 1"):
        api.completions.create(model="add3", prompt=PROMPT, n=0)
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be less than or equal to 2"):
        api.chat.completions.create(model="add3", messages=[{"role": "user", "content": "1"}], temperature=5)
    with pytest.raises(openai.BadRequestError, match="tools: not a parameter this server takes"):
        api.chat.completions.create(model="add3", messages=[{"role": "user", "content": "1"}],
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="echo=true is not supported"):
        api.completions.create(model="add3", prompt=PROMPT, echo=True)
    with pytest.raises(openai.BadRequestError, match=r"exceed model 'add3''s context of 256 tokens: give "
                                                     r"max_tokens <= 248"):
        api.completions.create(model="add3", prompt=PROMPT, max_tokens=300)
    with pytest.raises(openai.BadRequestError, match="the tokenizer cannot represent prompt 'abc'"):
        api.completions.create(model="add3", prompt="abc")
    with pytest.raises(openai.BadRequestError, match=r"token ids outside the vocabulary \[0, 20\)"):
        api.completions.create(model="add3", prompt=[5, 99])
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        api.chat.completions.create(model="add3", messages=[{"role": "user", "content": "1"}], top_logprobs=2)


def test_a_busy_sampler_holds_up_only_its_own_requests(api, served):
    gated = served["gated"].engine
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(
        api.completions.create(model="gated", prompt=PROMPT, max_tokens=3, temperature=0)))
    waiting.start()
    try:
        assert gated.entered.wait(10), "the gated request never reached its engine"
        assert api.completions.create(model="add3", prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text == \
            "579"  # served while the other request's generation waits
        assert "gated" in {m.id for m in api.models.list()}
        assert not answers
    finally:
        gated.gate.set()
        waiting.join(30)
    assert answers[0].choices[0].text == own_sample(served["tiny"], PROMPT, max_tokens=3, temperature=0)[1].text


def test_a_rollout_worker_serves_the_weights_it_holds(add3_policy, silent_learner):
    model, tokenizer = add3_policy
    worker = RolloutWorker(WorkerOptions(silent_learner, "w0", openai_port=0))  # the learner never answers
    try:
        url = worker.openai_server.url
        assert httpx.get(f"{url}/v1/models").json() == {"object": "list", "data": []}  # no weights yet
        worker.sampler = SamplingClient.for_model(model, tokenizer, version=7)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert sorted(m.id for m in api.models.list()) == ["heterorl:worker-w0/7", "latest"]
        for model_id in ("latest", "heterorl:worker-w0/7"):
            out = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0)
            assert (out.choices[0].text, out.system_fingerprint) == ("579", "heterorl-v7")
        with pytest.raises(openai.NotFoundError, match="served: heterorl:worker-w0/7, latest"):
            api.completions.create(model="heterorl:worker-w0/6", prompt=PROMPT)
    finally:
        worker.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/models")


def test_rollout_cli_checks_the_endpoint_options(capsys):
    assert main(["rollout", "--connect", "tcp://127.0.0.1:9", "--serve-openai-host", "0.0.0.0"]) == 2
    assert "--serve-openai-host needs --serve-openai PORT" in capsys.readouterr().err
    assert main(["rollout", "--connect", "tcp://127.0.0.1:9", "--serve-openai", "70000"]) == 2
    assert "--serve-openai 70000: give a port in 0..65535" in capsys.readouterr().err
