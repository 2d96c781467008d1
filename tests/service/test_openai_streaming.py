"""The OpenAI-compatible endpoint while it generates: streams send tokens as the engine draws them, a client that
goes away cancels its generation between decode steps, and concurrent requests share one engine call. An engine
that pauses after its first decode step makes each of these visible without depending on timing."""

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import pytest

from heterorl.engines.base import STOP_LENGTH, GenerationCancelled, GenerationWatch, SampleOutput, SamplingParams
from heterorl.engines.torch_engine import TorchEngine
from heterorl.policies import load_policy
from heterorl.service.openai_api import openai_app
from heterorl.service.openai_generation import ChoiceBuilder, Generation, RequestBatcher, finish
from heterorl.service.server import ServerThread
from heterorl.training.session import SamplingClient

PROMPT = "123+456="


class PausingEngine(TorchEngine):
    """A torch engine whose generations stop after their first decode step until ``gate`` is set. ``calls``: the
    prompts of each generation; ``cancelled_after``: how many decode steps a cancelled generation took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_step, self.gate = threading.Event(), threading.Event()
        self.calls, self.cancelled_after, self.watches = [], [], []

    def generate(self, prompts, params, num_samples=1, updates=None, watch=None):
        self.calls.append([list(p) for p in prompts])
        self.watches.append(watch)
        steps = 0

        def tokens(rows, drawn, logprobs):
            nonlocal steps
            steps += 1
            watch.tokens(rows, drawn, logprobs)
            if steps == 1:
                self.first_step.set()
                assert self.gate.wait(30), "the test never opened the gate"

        inner = GenerationWatch(tokens)
        inner.check = watch.check  # (the caller's cancel stops this generation)
        try:
            return super().generate(prompts, params, num_samples, updates, inner)
        except GenerationCancelled:
            self.cancelled_after.append(steps)
            raise


@pytest.fixture(scope="module")
def add3():
    return load_policy("add3-sft-base")


@pytest.fixture
def pausing(add3):
    model, tokenizer = add3
    client = SamplingClient(PausingEngine(model, tokenizer), tokenizer, version=5)
    yield client
    client.engine.gate.set()
    client.close()


@pytest.fixture
def server(pausing):
    with ServerThread(openai_app(lambda: {"add3": pausing})) as running:
        yield running


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_a_stream_sends_tokens_while_the_engine_still_generates(server, pausing):
    body = {"model": "add3", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, "logprobs": 1}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        # the engine is paused after its first step: this chunk cannot come from a finished generation
        assert not pausing.engine.gate.is_set() and len(pausing.engine.calls) == 1
        assert first["choices"][0]["text"] == "5" and first["system_fingerprint"] == "heterorl-v5"
        pausing.engine.gate.set()
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    text = first["choices"][0]["text"] + "".join(c["choices"][0]["text"] for c in rest)
    plain = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False}, timeout=30).json()
    assert text == plain["choices"][0]["text"] == "579"
    assert rest[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "stop"


def test_a_client_that_goes_away_cancels_its_generation_between_decode_steps(server, pausing):
    engine = pausing.engine
    body = json.dumps({"model": "add3", "prompt": PROMPT, "max_tokens": 200, "temperature": 1}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert engine.first_step.wait(30)
    wait_for(lambda: engine.watches[0].cancelled, "the server cancelled the generation of a closed connection")
    engine.gate.set()
    wait_for(lambda: engine.cancelled_after, "the cancelled generation stopped")
    assert engine.cancelled_after == [1]  # it stopped at the next step, not after 200
    # the sampler serves the next request as usual
    out = httpx.post(f"{server.url}/v1/completions", json={"model": "add3", "prompt": PROMPT, "max_tokens": 5,
                                                           "temperature": 0}, timeout=30).json()
    assert out["choices"][0]["text"] == "579"


def test_a_streaming_client_that_goes_away_cancels_its_generation(server, pausing):
    engine = pausing.engine
    body = {"model": "add3", "prompt": PROMPT, "max_tokens": 200, "temperature": 1, "stream": True,
            "stop": "never"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert engine.first_step.wait(30)
    wait_for(lambda: engine.watches[0].cancelled, "the server cancelled the stream of a closed connection")
    engine.gate.set()
    wait_for(lambda: engine.cancelled_after, "the cancelled generation stopped")
    assert engine.cancelled_after == [1]


def test_requests_waiting_for_a_busy_engine_share_its_next_call(pausing, add3):
    _, tokenizer = add3
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["123+456=", "111+222=", "500+300=", "321+123="]
    engine = pausing.engine

    async def scenario():
        batcher = RequestBatcher(pausing)

        def request(text, params=greedy):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return Generation([ids], 1, params, tokenizer=tokenizer, stops=[], token_ids=False, stream=False)

        first = request(prompts[0])
        batcher.submit(first)
        await asyncio.to_thread(engine.first_step.wait, 30)  # the engine is busy with the first request
        waiting = [request(p) for p in prompts[1:]]
        seeded = request(prompts[0], SamplingParams(max_tokens=6, temperature=0.0, seed=1))
        for generation in [*waiting, seeded]:
            batcher.submit(generation)
        engine.gate.set()
        return [await g.result() for g in [first, *waiting, seeded]]

    results = asyncio.run(scenario())
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # the three that waited went in one call; a seeded request never shares one (its completions would depend on
    # what it was batched with)
    assert engine.calls == [encoded[:1], encoded[1:], encoded[:1]]
    texts = [finish(tokenizer, [], groups[0][0], [], False).text for groups in results]
    alone = SamplingClient.for_model(add3[0], tokenizer)
    assert texts == [alone.sample(ids, 1, greedy).result()[0].text for ids in [*encoded, encoded[0]]]
    assert texts[:3] == ["579", "333", "800"]


def test_a_cancelled_request_that_waits_is_never_started(pausing, add3):
    _, tokenizer = add3
    engine = pausing.engine

    async def scenario():
        batcher = RequestBatcher(pausing)
        ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        first, second = (Generation([ids], 1, SamplingParams(max_tokens=4, seed=s), tokenizer=tokenizer, stops=[],
                                    token_ids=False, stream=False) for s in (1, 2))
        batcher.submit(first)
        await asyncio.to_thread(engine.first_step.wait, 30)
        batcher.submit(second)
        second.cancel()
        engine.gate.set()
        await first.result()
        with pytest.raises(GenerationCancelled):
            await second.result()

    asyncio.run(scenario())
    assert len(engine.calls) == 1


def test_the_settled_shares_of_any_completion_concatenate_to_its_text(add3):
    """Random completions and stop strings: what a stream sends (each token's share, sent once settled) is the
    answer's text, and a token is never sent before its share is final."""
    _, tokenizer = add3
    rng = random.Random(0)
    vocab = tokenizer.convert_tokens_to_ids(list("0123456789+=")) + [tokenizer.eos_token_id]
    for _ in range(300):
        tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 12))]
        stops = ["".join(rng.choice("0123456789+=") for _ in range(rng.randint(1, 3))) for _ in range(2)]
        builder, sent = ChoiceBuilder(tokenizer, [5], stops, False), []
        for token in tokens:
            settled = builder.add(token, -1.0)
            sent.extend(builder.choice.shares[len(sent):settled])
        builder.close("length")
        sent.extend(builder.choice.shares[len(sent):])
        whole = finish(tokenizer, [5], SampleOutput(tokens, [-1.0] * len(tokens), STOP_LENGTH), stops, False)
        assert "".join(sent) == builder.choice.text == whole.text
        assert sent == whole.shares


class BatchOnlyEngine(TorchEngine):
    """An engine that generates a batch in one call and reports nothing while it runs (as vLLM's)."""

    supports_watch = False

    def generate(self, prompts, params, num_samples=1, updates=None):
        return super().generate(prompts, params, num_samples, updates)


def test_an_engine_that_cannot_report_tokens_streams_them_when_it_is_done(add3):
    model, tokenizer = add3
    client = SamplingClient(BatchOnlyEngine(model, tokenizer), tokenizer, version=2)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2, "stop": "9"}
    with ServerThread(openai_app(lambda: {"m": client})) as server:
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == plain["choices"][index]["text"] == "57"
        assert mine[-1]["finish_reason"] == "stop"
    assert {c["system_fingerprint"] for c in chunks} == {"heterorl-v2"}
    client.close()
