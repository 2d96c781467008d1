"""`heterorl serve` refuses what would cost it before the cost (issue 63, round 3; docs/SERVICE.md, "Refusals"),
on real HTTP on loopback: bodies decoded off the event loop within bounds on their arrays and nesting, error
answers that quote a bounded excerpt of what they refuse, stop strings bounded, and numeric fields that would
make NaN or a 500 answered 400 (or made harmless)."""

import socket
import threading
import time

import httpx
import msgpack
import pytest

from heterorl.service.bounds import MAX_STOP_BYTES, MAX_STOP_STRINGS
from heterorl.service.calls import BadRequest
from heterorl.service.server import ServerThread, create_app
from heterorl.service.sessions import Service
from heterorl.service.tinker.convert import adam_params, sampling_params
from tests.service.test_abuse import AUTH, BASE, KEY, _call

MSGPACK = {**AUTH, "Content-Type": "application/msgpack"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    service = Service(tmp_path_factory.mktemp("state"), result_ttl_s=60, max_sessions=4)
    with ServerThread(create_app(service, api_key=KEY, max_body_bytes=40 * 2**20)) as server:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
            session = http.post("/api/v1/sessions", json={"base_model": BASE, "seed": 0}).json()["session_id"]
            model = _call(http, session, "save_weights_and_get_sampling_client")["result"]["value"]["model"]
        yield server, session, model
    service.close()


def _health_while(server, request) -> tuple[httpx.Response, float]:
    """``request`` (a function of an httpx client) answered, and the slowest ``/health`` answer meanwhile."""
    slowest, done = [0.0], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            while not done.is_set():
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                slowest[0] = max(slowest[0], time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answer = request(http)
    finally:
        done.set()
        poller.join()
    return answer, slowest[0]


def test_a_30_mb_msgpack_array_of_nils_is_refused_at_once_in_a_short_answer_and_health_answers(served):
    """A 30 MB msgpack array of 30M nils blocked the event loop for 32 s and was echoed back in a 143 MB 422.
    Now an array of more than 1,048,576 entries is refused as the decoder meets it, the answer quotes no input, and
    /health answers within a second throughout; a body within the element bound that does not validate is answered
    with an excerpt of what it refused, not the value."""
    server, session, _ = served
    nils = msgpack.packb([None] * 30_000_000)
    answer, slowest = _health_while(server, lambda http: http.post(
        f"/api/v1/sessions/{session}/calls", content=nils, headers=MSGPACK))
    assert answer.status_code == 422 and "max_array_len" in answer.text and len(answer.content) < 4096, (
        answer.status_code, answer.content[:300], len(answer.content))
    assert slowest < 1.0, slowest
    within = msgpack.packb({"method": [None] * 1_000_000})  # (1M entries: the bound) — not a string
    answer, slowest = _health_while(server, lambda http: http.post(
        f"/api/v1/sessions/{session}/calls", content=within, headers=MSGPACK))
    assert answer.status_code == 422 and len(answer.content) < 4096, (answer.status_code, len(answer.content))
    assert answer.json()["detail"][0]["loc"] == ["method"] and slowest < 1.0


def test_bodies_nested_too_deeply_are_a_422_not_a_500_or_a_dropped_connection(served):
    server, session, _ = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        deep_json = http.post("/api/v1/sessions", content=b"[" * 200_000 + b"]" * 200_000,
                              headers={"Content-Type": "application/json"})
        assert deep_json.status_code == 422 and "nested too deeply" in deep_json.text, deep_json.text[:300]
        tinker = http.post("/tinker/api/v1/create_model", content=b"{\"a\":" * 100_000 + b"1" + b"}" * 100_000,
                           headers={"Content-Type": "application/json"})
        assert tinker.status_code == 422 and "nested too deeply" in tinker.text, tinker.text[:300]
        deep_msgpack = b"\x91" * 200_000 + b"\xc0"  # arrays of one array, 200,000 deep
        answer = http.post(f"/api/v1/sessions/{session}/calls", content=deep_msgpack, headers=MSGPACK)
        assert answer.status_code == 422 and len(answer.content) < 4096, answer.text[:300]
        assert http.get("/health").status_code == 200


def test_stop_strings_are_bounded_before_any_is_encoded(served):
    """Four 8 MB stop strings froze the whole server for 159 s. A stop string is at most 1,024 bytes, and a
    call gives at most 16 (4 on the OpenAI routes, as OpenAI's API), or 256 stop token ids."""
    server, _, model = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        start = time.monotonic()
        answer = http.post("/v1/completions", json={"model": model, "prompt": "1+1=", "max_tokens": 2,
                                                     "stop": ["x" * 8_000_000] * 4})
        assert answer.status_code == 400 and f"longer than {MAX_STOP_BYTES:,} bytes" in answer.text, answer.text[:300]
        assert len(answer.content) < 4096 and time.monotonic() - start < 30
        ok = http.post("/v1/completions", json={"model": model, "prompt": "1+1=", "max_tokens": 2,
                                                 "stop": ["=" * 1024]})
        assert ok.status_code == 200, ok.text[:300]
    with pytest.raises(BadRequest, match=f"longer than {MAX_STOP_BYTES:,} bytes"):
        sampling_params({"stop": ["é" * 600]})  # (1,200 bytes in UTF-8)
    with pytest.raises(BadRequest, match=f"at most {MAX_STOP_STRINGS} are taken"):
        sampling_params({"stop": ["a"] * (MAX_STOP_STRINGS + 1)})
    with pytest.raises(BadRequest, match="stop token ids"):
        sampling_params({"stop": list(range(257))})
    assert sampling_params({"stop": ["a" * 1024] * MAX_STOP_STRINGS})[1] == ["a" * 1024] * MAX_STOP_STRINGS


def test_numbers_that_made_nan_or_a_500_are_refused_or_harmless(served):
    """top_p=1e-300 compared as 0 in float32 and kept no token (a plain-text 500); a temperature of 1e-300 made the
    logits infinite; a learning rate of 1e30 was taken and the model NaN for good."""
    server, session, model = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        for params in ({"top_p": 1e-300, "max_tokens": 3}, {"temperature": 1e-300, "max_tokens": 3}):
            call = http.post("/api/v1/samplers/calls", json={"model": model, "method": "sample", "args": {
                "prompt_tokens": [1, 2, 3], "num_samples": 2, "sampling_params": params}})
            assert call.status_code == 200, call.text[:300]
            done = http.get(f"/api/v1/futures/{call.json()['future_id']}", params={"wait_s": 60}).json()
            assert done["status"] == "done" and "error" not in done, (params, done)
        for params, named in (({"learning_rate": 1e30}, "learning_rate"), ({"eps": 0.0}, "eps"),
                              ({"beta2": 1.0}, "beta2"), ({"grad_clip_norm": -1.0}, "grad_clip_norm")):
            answer = http.post(f"/api/v1/sessions/{session}/calls", json={"method": "optim_step", "args": {
                "params": params}})
            assert answer.status_code == 400 and answer.json()["error"]["type"] == "ConfigError", answer.text[:300]
            assert f"AdamParams.{named}" in answer.json()["detail"], answer.text[:300]
    with pytest.raises(BadRequest, match="AdamParams.learning_rate"):
        adam_params({"learning_rate": 1e30})


def _raw_get(server, headers: bytes) -> bytes:
    """A GET /health with ``headers`` on a socket of its own: the status line and headers of the answer."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    return answer


def test_a_request_with_too_many_or_too_large_headers_is_a_431(served):
    """10,000 headers, or one of 1 MB, were taken. At most 100 fields and 64 KiB of them: 431 beyond, as the
    parser meets them."""
    server, _, _ = served
    many = b"".join(b"x-h%d: 1\r\n" % i for i in range(10_000))
    assert _raw_get(server, many).startswith(b"HTTP/1.1 431")
    assert _raw_get(server, b"x-big: " + b"a" * 2**20 + b"\r\n").startswith(b"HTTP/1.1 431")
    assert _raw_get(server, b"x-h: 1\r\n" * 50).startswith(b"HTTP/1.1 200")
