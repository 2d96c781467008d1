"""`heterorl serve` under concurrent and hostile clients (real HTTP on loopback, and the app's ASGI entry where a
test must count what the server read): users arriving at once, requests bounded before work is done, the key
before the body, request ids that cannot fetch another call's result, and no model, path or page given away."""

import asyncio
import os
import threading
from concurrent.futures import Future

import httpx
import pytest

import heterorl.service.openai_api as openai_api
from heterorl.service.calls import TooBusy
from heterorl.service.server import ServerThread, create_app
from heterorl.service.sessions import Service

BASE = "add3-sft-base"
KEY = "abuse-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    service = Service(tmp_path_factory.mktemp("state"), result_ttl_s=60, max_sessions=16)
    with ServerThread(create_app(service, api_key=KEY, max_body_bytes=32 * 2**20)) as server:
        yield server, service
    service.close()


def _session(http: httpx.Client) -> str:
    created = http.post("/api/v1/sessions", json={"base_model": BASE, "seed": 0})
    assert created.status_code == 200, created.text
    return created.json()["session_id"]


def _call(http: httpx.Client, session: str, method: str, **extra) -> dict:
    """The call's result, waited for up to 5 minutes (30 s a poll: a loaded machine may take more than one)."""
    future = http.post(f"/api/v1/sessions/{session}/calls", json={"method": method, **extra}).json()["future_id"]
    for _ in range(10):
        answer = http.get(f"/api/v1/futures/{future}", params={"wait_s": 30}).json()
        if answer.get("status") != "pending":
            break
    return answer | {"future_id": future}


def test_sessions_created_by_8_clients_at_once_all_load_and_the_next_one_too(served):
    """problem 1: concurrent loads raced in transformers' process-wide init patching"""
    server, service = served
    answers, barrier = [], threading.Barrier(8)

    def create() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
            barrier.wait()
            answers.append(http.post("/api/v1/sessions", json={"base_model": BASE}))

    threads = [threading.Thread(target=create) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        later = _session(http)
        for session in [a.json()["session_id"] for a in answers] + [later]:
            assert http.delete(f"/api/v1/sessions/{session}").status_code == 200


def _asgi(app, method: str, path: str, headers: dict, chunks: list[bytes]) -> tuple[int, int]:
    """Send a request to the app's ASGI entry, its body chunked (no length); (its status, how many body bytes
    were read)."""
    headers = {**headers, "transfer-encoding": "chunked"}
    read, status = 0, []
    pending = list(chunks)

    async def receive():
        nonlocal read
        if not pending:
            return {"type": "http.disconnect"}
        chunk = pending.pop(0)
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(app(scope, receive, send))
    return status[0], read


def test_without_the_key_no_body_is_read_and_a_chunked_body_stops_at_the_limit(tmp_path):
    """problem 3: the key is checked on the headers; a body without a length is cut at the limit"""
    app = create_app(Service(tmp_path), api_key=KEY, max_body_bytes=1 << 20)
    megabyte = b"x" * (1 << 20)
    for path in ("/v1/completions", "/api/v1/sessions", "/docs"):
        status, read = _asgi(app, "POST", path, {"content-type": "application/json"}, [megabyte] * 64)
        assert (status, read) == (401, 0), path
    status, read = _asgi(app, "POST", "/api/v1/sessions", {**{k.lower(): v for k, v in AUTH.items()},
                                                            "content-type": "application/json"}, [megabyte] * 64)
    assert status == 413 and read <= 2 * len(megabyte)  # (the chunk that crossed the limit, at most)
    status, read = _asgi(app, "POST", "/v1/completions", {**{k.lower(): v for k, v in AUTH.items()},
                                                          "content-type": "application/json"}, [megabyte] * 64)
    assert status == 413 and read <= 2 * len(megabyte)


@pytest.fixture(scope="module")
def sampler_model(served):
    server, _ = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        session = _session(http)
        model = _call(http, session, "save_weights_and_get_sampling_client")["result"]["value"]["model"]
        yield session, model
        http.delete(f"/api/v1/sessions/{session}")


def test_prompts_and_generation_are_bounded_before_any_work(served, sampler_model, monkeypatch):
    """problems 2 and 4: size checks come before tokenizing, and one request cannot ask for unbounded tokens"""
    server, _ = served
    session, model = sampler_model
    encoded = []
    real = openai_api.encode_prompt
    monkeypatch.setattr(openai_api, "encode_prompt", lambda *a, **k: encoded.append(1) or real(*a, **k))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for prompt, named in (("1" * 4_000_000, "characters of prompt text"), ([[1]] * 300_000, "1024 prompts")):
            refused = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
            assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text[:300]
        chat = http.post("/v1/chat/completions", json={"model": model, "messages": [
            {"role": "user", "content": "2" * 300_000}]})
        assert chat.status_code == 400 and "characters of message text" in chat.text
        greedy = http.post("/v1/completions", json={"model": model, "prompt": "1+1=", "n": 128, "max_tokens": 4096})
        assert greedy.status_code == 400 and "at most 262,144" in greedy.json()["error"]["message"]
        assert encoded == []  # nothing above was tokenized
        big = http.post("/api/v1/samplers/calls", json={"model": model, "method": "sample", "args": {
            "prompt_tokens": [1, 2, 3], "num_samples": 50_000, "sampling_params": {"max_tokens": 240}}})
        assert big.status_code == 400 and "split it into smaller calls" in big.json()["detail"]
        seed = http.post("/api/v1/samplers/calls", json={"model": model, "method": "sample", "args": {
            "prompt_tokens": [1, 2, 3], "sampling_params": {"seed": 2**70}}})
        assert seed.status_code == 400 and "seed" in seed.json()["detail"]
        ok = http.post("/v1/completions", json={"model": model, "prompt": "1+1=", "max_tokens": 2})
        assert ok.status_code == 200 and encoded == [1]  # and a request in bounds is served


def test_training_calls_are_bounded_before_any_work(served, sampler_model, monkeypatch):
    """issue 63, problem 1: one datum of 20M tokens (the model's context is 256) was accepted and took the server
    from 388 MB to 6.4 GB. Now a forward or forward_backward call is checked from its arguments before any Datum or
    tensor is made: the model's context, the tokens of one call, the model's token ids, the fields of a datum."""
    import heterorl.service.sessions as sessions

    server, _ = served
    session, _ = sampler_model
    made = []
    real = sessions.wire.datum_from_wire
    monkeypatch.setattr(sessions.wire, "datum_from_wire", lambda raw: made.append(1) or real(raw))

    def refused(method: str, datums: list, named: str) -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            answer = http.post(f"/api/v1/sessions/{session}/calls", json={"method": method, "args": {
                "datums": datums}})
        assert answer.status_code == 400 and named in answer.json()["detail"], answer.text[:300]

    refused("forward_backward", [{"tokens": [1] * 300_000, "prompt_len": 1}], "this model's context is 256")
    refused("forward", [{"tokens": [1, 2, 3], "prompt_len": 1}] * 200_000, "split it into smaller calls")
    refused("forward", [{"tokens": [1] * 200, "prompt_len": 1}] * 1_400, "more than 262,144 tokens")
    refused("forward_backward", [{"tokens": [1, 2, 10**9], "prompt_len": 1}], "token id 1000000000")
    refused("forward_backward", [{"tokens": [1, 2, -1], "prompt_len": 1}], "token id -1")
    refused("forward_backward", [{"tokens": [1, 2, 3], "prompt_len": 1, "extra": 1}], "unknown field(s) extra")
    refused("forward_backward", [{"tokens": [1, 2, 3], "prompt_len": 1, "weights": [1.0] * 9}], "weights must be")
    refused("forward", [], "non-empty list of datums")
    assert made == []  # no datum was made of any of them
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        ok = _call(http, session, "forward", args={"datums": [{"tokens": [1, 2, 3], "prompt_len": 1}]})
    assert ok["status"] == "done" and "error" not in ok and made == [1], ok  # and a call in bounds is served


def test_a_request_id_is_the_callers_own_session_and_method(served):
    """problem 8: the same request id in another session or for another method is another request"""
    server, _ = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        first, second = _session(http), _session(http)
        a = _call(http, first, "save_weights_for_sampler", request_id="same")
        b = _call(http, second, "save_weights_for_sampler", request_id="same")
        assert a["future_id"] != b["future_id"]
        assert a["result"]["value"] == b["result"]["value"] == 1  # each session's own save ran
        state = _call(http, first, "save_state", args={"name": "ckpt"}, request_id="same")
        assert state["future_id"] != a["future_id"] and state["result"]["value"] == "ckpt"  # it ran
        retried = http.post(f"/api/v1/sessions/{first}/calls", json={"method": "save_state", "args": {
            "name": "ckpt"}, "request_id": "same"}).json()["future_id"]
        assert retried == state["future_id"]  # a retry of the same call still runs once
        for session in (first, second):
            http.delete(f"/api/v1/sessions/{session}")


def test_latest_docs_paths_and_links_give_nothing_away(served, sampler_model, tmp_path):
    """problem 9: "latest" is never another user's model; no docs without the key, no path oracle, no links"""
    server, service = served
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        other = _session(http)
        _call(http, other, "save_weights_and_get_sampling_client")
        ambiguous = http.post("/api/v1/samplers/calls", json={"model": "latest", "method": "sample", "args": {
            "prompt_tokens": [1, 2]}})
        assert ambiguous.status_code == 400 and "ambiguous" in ambiguous.json()["detail"]
        assert "latest" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        for page in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(page).status_code == 404
            assert httpx.get(server.url + page).status_code == 401
        answers = [http.post("/api/v1/sessions", json={"base_model": path}) for path in
                   ("/etc", "/no/such/folder", str(tmp_path))]
        assert {a.status_code for a in answers} == {400}
        assert len({a.json()["detail"].split("is not a base model here")[1] for a in answers}) == 1  # the same
        planted = service.state_dir / other / "planted"
        planted.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/etc/hostname", planted)
        followed = http.post(f"/api/v1/sessions/{other}/calls", json={"method": "load_state", "args": {
            "name": "planted"}})
        assert followed.status_code == 400 and "is a link" in followed.json()["detail"]
        assert "/etc" not in followed.text and str(service.state_dir) not in followed.text
        (service.state_dir / other / "garbage").write_bytes(b"not a state")
        broken = _call(http, other, "load_state", args={"name": "garbage"})
        assert "cannot be loaded" in str(broken["error"]) and str(service.state_dir) not in str(broken)
        http.delete(f"/api/v1/sessions/{other}")


def test_calls_beyond_the_queue_limit_are_429_with_retry_after(tmp_path):
    """problem 4: the call queue is capped per session and in all"""
    from heterorl.policies import load_policy

    service = Service(tmp_path, max_pending_per_session=2, max_pending=3,
                      loader=lambda name: load_policy(BASE))
    with ServerThread(create_app(service, api_key=KEY)) as server, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        first, second = _session(http), _session(http)
        for owner in (first, first, second):  # calls still waiting (their futures never finish here)
            service.calls.submit(owner, "stuck", None, Future)
        refused = http.post(f"/api/v1/sessions/{first}/calls", json={"method": "optim_step"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "session" in refused.json()["detail"]
        with pytest.raises(TooBusy, match="this service has 3 calls"):
            service.call(second, "optim_step", {})
    service.close()


def test_connections_that_never_finish_their_headers_are_closed_and_health_still_answers(tmp_path):
    """problem 6: half-sent headers were held forever (slowloris)"""
    import socket

    with ServerThread(create_app(Service(tmp_path), api_key=KEY), header_timeout_s=0.5) as server:
        slow = []
        for _ in range(40):
            sock = socket.create_connection((server.host, server.port), timeout=30)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
            slow.append(sock)
        assert httpx.get(server.url + "/health", timeout=30).json() == {"ok": True}
        for sock in slow:
            assert sock.recv(1024) == b""  # closed by the server (the 30 s socket timeout would raise instead)
            sock.close()
        idle = socket.create_connection((server.host, server.port), timeout=30)
        assert idle.recv(1024) == b""  # one that sends nothing at all too
        idle.close()


def test_a_body_that_stops_arriving_after_complete_headers_is_closed(tmp_path):
    """slowloris on the body: complete headers, then a body sent slower than the idle limit"""
    import socket

    with ServerThread(create_app(Service(tmp_path), api_key=KEY), body_idle_s=0.5) as server:
        slow = []
        for _ in range(20):
            sock = socket.create_connection((server.host, server.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                         b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            slow.append(sock)
        assert httpx.get(server.url + "/health", timeout=30).json() == {"ok": True}
        for sock in slow:
            assert sock.recv(1024) == b""  # closed by the server (the 30 s socket timeout would raise instead)
            sock.close()
        # a whole request on a connection of its own is answered as usual
        answer = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"model": "m", "prompt": "1"})
        assert answer.status_code == 404


def test_sigterm_stops_the_service_within_its_grace_and_says_what_it_aborted(tmp_path):
    """problem 4: a request in flight (here a body that never arrives) held the stop for as long as it lasted"""
    import re
    import signal
    import socket
    import time

    from heterorl.bench.service import start_service
    grace_s = 2.0
    process, url = start_service("--shutdown-grace-s", str(grace_s), state_dir=str(tmp_path))
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=60) as stuck:
        stuck.sendall(b"POST /api/v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
        time.sleep(0.5)  # (it is in flight before the signal or after: the stop is bounded either way)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s + 30)
        finally:
            process.kill()
    log = (tmp_path / "serve.log").read_text()
    assert process.returncode == 0, log[-2000:]
    assert "heterorl serve stopped on SIGTERM: 0 queued calls cancelled, 0 running calls aborted" in log


def test_an_idle_session_expires_and_frees_its_place(tmp_path):
    """problem 5: sessions never expired; a loop run as many times as --max-sessions filled the service"""
    import time

    from heterorl.policies import load_policy
    from heterorl.service.calls import NotFound

    service = Service(tmp_path, max_sessions=1, session_ttl_s=0.2, loader=lambda name: load_policy(BASE))
    first = service.create_session(BASE)["session_id"]
    time.sleep(0.3)  # (longer than the time to live: it is idle past it)
    second = service.create_session(BASE)["session_id"]  # the place the idle one held
    with pytest.raises(NotFound, match="idle past --session-ttl-s"):
        service.session(first)
    assert service.session_ids() == [second]
    service.close()


def test_a_client_reattaches_by_id_and_a_saved_state_is_reopened_after_a_restart(tmp_path):
    """problem 7: after a restart saved states were unreachable by new sessions; no client could re-attach"""
    from heterorl.errors import HeteroRLError
    from heterorl.service.client import connect

    state_dir = tmp_path / "state"
    first = Service(state_dir)
    with ServerThread(create_app(first, api_key=KEY)) as server, connect(server.url, api_key=KEY) as client:
        training = client.create_training_client(BASE, seed=0)
        training.save_weights_for_sampler().result()  # version 1
        training.save_state("before-restart").result()
        with connect(server.url, api_key=KEY) as other:  # another connection, e.g. another process
            again = other.training_client(training.session_id)
            assert (again.session_id, again.version) == (training.session_id, 1)
        with pytest.raises(HeteroRLError, match="404"):
            client.training_client("s-000000000000")
        old_session, old_weights = training.session_id, training.save_weights_for_sampler().result()[1]
    first.close()
    second = Service(state_dir)  # the service restarted: its sessions are gone, its states are not
    with ServerThread(create_app(second, api_key=KEY)) as server, connect(server.url, api_key=KEY) as client:
        with pytest.raises(HeteroRLError, match="404"):
            client.training_client(old_session)
        reopened = client.create_training_client_from_state(BASE, old_session, "before-restart")
        assert reopened.version == 1 and reopened.session_id != old_session
        version, weights = reopened.save_weights_for_sampler().result()
        assert version == 2 and all((weights[k] == old_weights[k]).all() for k in old_weights)
        bad = client.create_training_client(BASE)
        with pytest.raises(HeteroRLError, match="not a session id"):
            bad.load_state("before-restart", session="../etc").result()
    second.close()


def test_a_sampling_call_its_client_cancels_stops_between_decode_steps_and_a_waiting_one_never_runs(served):
    """problem 4: a call could not be cancelled; `future.cancel()` of a remote call now cancels it on the service"""
    import time

    from heterorl.engines.base import SamplingParams
    from heterorl.service.client import connect

    server, service = served
    with connect(server.url, api_key=KEY) as client:
        training = client.create_training_client(BASE, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        prompt = training.tokenizer.encode("123+456=")
        huge = SamplingParams(max_tokens=240, ignore_eos=True)  # 1024 x 240 tokens: far longer than this test
        running = sampler.sample([prompt] * 1024, 1, huge)
        waiting = sampler.sample([prompt] * 1024, 1, huge)
        call = service.get_call(running.future_id)
        deadline = time.monotonic() + 60
        while not call.future.running():
            assert time.monotonic() < deadline, "the first call never started"
            time.sleep(0.01)
        ended = {name: f.exception() for name, f in (("waiting", waiting), ("running", running)) if f.done()}
        assert not ended, f"a call ended before it was cancelled: {ended}"  # (its error says why: the service's)
        assert waiting.cancel() and running.cancel()
        assert service.get_call(waiting.future_id).future.cancelled()  # never ran
        error = call.future.exception(timeout=60)
        assert type(error).__name__ == "GenerationCancelled"
        assert service.cancel_call(running.future_id) == "done"
        assert len(sampler.sample(prompt, 2, SamplingParams(max_tokens=3)).result()) == 2  # it serves on
        training.close()


def test_cancel_wins_over_the_poll_that_sees_the_service_cancel_the_call():
    """The service answers the poll of a call it cancels at once; when that answer lands before the DELETE
    returns, `cancel()` still cancels (it once returned False and left the call's error on the future)."""
    from heterorl.errors import HeteroRLError
    from heterorl.service.client import RemoteFuture

    class PollerWinsTheRace:
        sent = 0

        def _request(self, method, path):
            assert (method, path) == ("DELETE", "/api/v1/futures/f1")
            self.sent += 1
            try:  # what the polling thread does when the service's answer arrives first
                future.set_exception(HeteroRLError("cancelled on the service"))
            except Exception:  # InvalidStateError: the future is cancelled already (the poller ignores it)
                pass

    service = PollerWinsTheRace()
    future = RemoteFuture(service, "f1")
    assert future.cancel() and future.cancelled()
    assert future.cancel() and service.sent == 1  # cancelled already: nothing more is sent


def test_latest_is_each_keys_own_newest_sampler_and_sessions_are_named_and_listed(tmp_path):
    """With a key per user, each user's "latest" is the newest sampler of its own session (the documented OpenAI
    snippet works for each); a user's second session is told apart by its name, in the model id or in the
    X-Heterorl-Session header; sessions are listed with their names; another key's sessions do not exist."""
    from heterorl.service.guard import CALLER, Caller

    service = Service(tmp_path, result_ttl_s=60, max_sessions=8)
    with ServerThread(create_app(service, api_key=["key-alice", "key-bob"], max_body_bytes=32 * 2**20)) as server, \
            httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-alice"}, timeout=120) as alice, \
            httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-bob"}, timeout=120) as bob:
        a = alice.post("/api/v1/sessions", json={"base_model": BASE, "seed": 0, "name": "alice-run"}).json()
        b = bob.post("/api/v1/sessions", json={"base_model": BASE, "seed": 0}).json()
        assert a["name"] == "alice-run" and b["name"] is None
        taken = bob.post("/api/v1/sessions", json={"base_model": BASE, "name": "alice-run"})
        assert taken.status_code == 400 and "named 'alice-run' already" in taken.json()["detail"]
        for http, session in ((alice, a), (bob, b)):
            _call(http, session["session_id"], "save_weights_and_get_sampling_client")
        for http in (alice, bob):  # the snippet, as each user runs it
            out = http.post("/v1/completions", json={"model": "latest", "prompt": "1+1=", "max_tokens": 2})
            assert out.status_code == 200, out.text
        for key, owner in ((0, a), (1, b)):
            token = CALLER.set(Caller(key))
            try:
                assert service.sampler("latest")[0] == owner["session_id"]
            finally:
                CALLER.reset(token)
        assert alice.get("/api/v1/sessions").json()["described"] == [{
            "session_id": a["session_id"], "name": "alice-run", "base_model": BASE, "version": 1,
            "latest": "heterorl:alice-run/latest"}]
        assert bob.get(f"/api/v1/sessions/{a['session_id']}").status_code == 404
        refused = bob.post("/v1/completions", json={"model": "heterorl:alice-run/latest", "prompt": "1",
                                                    "max_tokens": 1})
        assert refused.status_code == 404 and "alice" not in refused.json()["error"]["message"].split("serving")[1]
        assert not any("alice" in m["id"] or a["session_id"] in m["id"] for m in bob.get("/v1/models").json()["data"])
        second = alice.post("/api/v1/sessions", json={"base_model": BASE, "seed": 1, "name": "alice-2"}).json()
        _call(alice, second["session_id"], "save_weights_and_get_sampling_client")
        ambiguous = alice.post("/v1/completions", json={"model": "latest", "prompt": "1", "max_tokens": 1})
        assert ambiguous.status_code == 400 and "alice-run, alice-2" in ambiguous.text, ambiguous.text
        assert "X-Heterorl-Session" in ambiguous.text
        for request in ({"headers": {"X-Heterorl-Session": "alice-2"}, "model": "latest"},
                        {"headers": {}, "model": "heterorl:alice-2/latest"}):
            out = alice.post("/v1/completions", headers=request["headers"], json={
                "model": request["model"], "prompt": "1+1=", "max_tokens": 2})
            assert out.status_code == 200, out.text
        assert bob.post("/v1/completions", json={"model": "latest", "prompt": "1", "max_tokens": 1}).status_code == 200
    service.close()


def test_a_long_poll_answers_done_even_while_an_earlier_done_callback_still_runs():
    """A training call's future has the memory accounting's done callback before the call book's (`_finish`,
    which puts the result in wire form); under load that callback (it trims the allocator) ran long, and a
    long-poll that came while it ran saw the future done and answered "pending" at once, its wait unused."""
    from heterorl.service.calls import CallBook

    book = CallBook(result_ttl_s=60, max_pending_per_session=4, max_pending=4)
    future: Future = Future()
    future.add_done_callback(lambda _: threading.Event().wait(0.5))  # (the accounting, slow)
    call_id = book.submit("s", "forward", None, lambda: future)
    finishing = threading.Thread(target=future.set_result, args=(None,))
    finishing.start()  # (done at once; its callbacks run in that thread, the slow one first)
    threading.Event().wait(0.1)
    answer = asyncio.run(book.poll(book.get(call_id), wait_s=30))
    finishing.join()
    assert answer["status"] == "done" and "error" not in answer, answer
