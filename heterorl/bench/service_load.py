"""``heterorl bench serve-load``: `heterorl serve` under many clients, one of them hostile, side by side in one run.

1. **Batching.** ``/v1/completions`` requests/s from 8 and from 50 concurrent clients (``--max-tokens`` tokens each,
   unseeded, temperature 1) against two `heterorl serve` processes on this machine, one with concurrent requests
   batched into shared engine calls and one without (``--no-openai-batching``); rounds alternate between them.
2. **Load with an abuser.** 50 honest clients (``--openai-clients`` on the OpenAI endpoint, half of them
   streaming, and ``--session-clients`` sampling through the session API, each on its own session's model) run
   ``--requests`` requests each, once alone and once while one abusive client (`Abuser`) floods the same
   service: sampling calls of the largest size allowed on its own session until refused (429), huge OpenAI
   requests it abandons mid-generation, bodies past the size limit, malformed JSON, requests without the key,
   connections that never finish their headers, and what cost the service before its round-3 bounds
   (`Abuser._round_3`: a 30 MB msgpack array of nils, four 8 MB stop strings, JSON nested 100,000 deep, the
   largest forward_backward, top_p 1e-300, a learning rate of 1e30, 10,000 headers). Reported: the honest
   requests' p50 / p99 / max latency in both rounds, how many failed (goal: none), and what the abuser's
   requests got.

Every honest request must succeed; the service answers /health throughout.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from heterorl.addresses import parse_host_port
from heterorl.bench.service import BASE, _completions_rate, start_service

KEY = "bench-serve-load"


@dataclass
class LoadResult:
    """What a round of honest clients met: each request's latency (s), and the failures (what went wrong)."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _completion(http: httpx.Client, model: str, prompt: str, max_tokens: int, stream: bool) -> str:
    """One honest completion; its text. Raises on any answer but a complete one."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": stream}
    if not stream:
        response = http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]
    text, done = "", False
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                text += "".join(c["text"] for c in chunk["choices"])
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return text


def _session_sample(http: httpx.Client, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    """One honest sampling call through the session API (submit, then long-poll); its samples."""
    submitted = http.post("/api/v1/samplers/calls", json={"model": model, "method": "sample", "args": {
        "prompt_tokens": prompts, "num_samples": 4, "sampling_params": {"max_tokens": max_tokens}}})
    submitted.raise_for_status()
    future = submitted.json()["future_id"]
    while True:
        state = http.get(f"/api/v1/futures/{future}", params={"wait_s": 30})
        state.raise_for_status()
        state = state.json()
        if state["status"] == "done":
            if "error" in state:
                raise RuntimeError(f"sample failed: {state['error']}")
            return state["result"]


def honest_load(url: str, openai_model: str, session_model: str, prompts: list[list[int]], *,
                openai_clients: int, session_clients: int, requests: int, max_tokens: int) -> LoadResult:
    """``openai_clients`` OpenAI clients (every other one streaming) and ``session_clients`` session-API clients,
    each sending ``requests`` requests one after another; every latency and failure."""
    result, lock = LoadResult(), threading.Lock()
    start = threading.Barrier(openai_clients + session_clients)

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
            start.wait()
            for _ in range(requests):
                began = time.perf_counter()
                try:
                    if i < openai_clients:
                        _completion(http, openai_model, f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=",
                                    max_tokens, stream=i % 2 == 1)
                    else:
                        _session_sample(http, session_model, rng.sample(prompts, 2), max_tokens)
                    took, failure = time.perf_counter() - began, None
                except Exception as exc:  # (counted: the goal is none)
                    took, failure = None, f"{type(exc).__name__}: {str(exc)[:200]}"
                with lock:
                    if failure is None:
                        result.latencies.append(took)
                    else:
                        result.failures.append(failure)

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(openai_clients + session_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result


class Abuser:
    """One hostile client, holding the service's key, on its own session's model ``model``: until `stop`, it cycles
    through what a hostile or broken client does, and counts the answers it got (`got`: "what: status" → count).
    Entering it returns once its first cycle is done (every kind of abuse tried once, the half-open connections
    held), so that whatever runs inside it runs under abuse."""

    def __init__(self, url: str, model: str, prompt: list[int], *, slow_connections: int = 100) -> None:
        self.url, self.model, self.prompt, self.slow_connections = url, model, prompt, slow_connections
        self.got: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abuser", daemon=True)
        self._held: list[socket.socket] = []
        self._first_cycle = threading.Event()
        self.error: BaseException | None = None
        self._nils = self._stops = None  # (round 3's large bodies, made at their first use)
        self._trainer: tuple[str, str] | None = None  # (its second session, and that session's model)

    def __enter__(self) -> Abuser:
        self._thread.start()
        if not self._first_cycle.wait(300) or self.error is not None:
            self.stop()
            raise RuntimeError(f"the abuser's first cycle did not finish: {self.error or 'not in 300 s'}")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        for sock in self._held:
            sock.close()

    def _note(self, what: str, status: int | str) -> None:
        self.got[f"{what}: {status}"] += 1

    def _run(self) -> None:
        try:
            self._cycle()
        except BaseException as exc:  # (reported by __enter__, or left in .error)
            self.error = exc
        finally:
            self._first_cycle.set()

    def _cycle(self) -> None:
        host, port = parse_host_port(self.url, "the service's url", "http://127.0.0.1:8765")
        auth = {"Authorization": f"Bearer {KEY}"}
        huge = {"prompt_tokens": [self.prompt] * 1024, "num_samples": 1,
                "sampling_params": {"max_tokens": 240, "ignore_eos": True}}  # near the most one call may ask
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self._stop.is_set():
                for _ in range(100):  # its own session's queue, flooded until it is refused
                    r = http.post("/api/v1/samplers/calls", headers=auth,
                                  json={"model": self.model, "method": "sample", "args": huge})
                    self._note("max-size sample calls", r.status_code)
                    if r.status_code == 429:
                        break
                try:  # a huge generation, abandoned: its client goes away
                    r = http.post("/v1/completions", headers=auth, timeout=0.5, json={
                        "model": self.model, "prompt": [self.prompt] * 64, "n": 16, "max_tokens": 240,
                        "ignore_eos": True})
                    self._note("abandoned OpenAI requests", r.status_code)
                except httpx.TimeoutException:
                    self._note("abandoned OpenAI requests", "dropped")
                self._note("declared 200 MB bodies", _raw_status(host, port, (
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {200 * 2**20}\r\n\r\n{{").encode()))
                r = http.post("/v1/completions", headers=auth | {"Content-Type": "application/json"},
                              content=b"{not json")
                self._note("malformed JSON", r.status_code)
                r = http.post("/v1/completions", json={"model": self.model, "prompt": "1+1="})
                self._note("requests without the key", r.status_code)
                r = http.post("/v1/completions", headers=auth, json={"model": self.model, "prompt": "1" * 300_000})
                self._note("300,000-character prompts", r.status_code)
                self._round_3(http, auth, host, port)
                while len(self._held) < self.slow_connections and not self._stop.is_set():
                    sock = socket.create_connection((host, port))
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # (the headers never end)
                    self._held.append(sock)
                    self._note("half-sent headers", "held")
                self._first_cycle.set()
                self._stop.wait(0.2)


    def _round_3(self, http: httpx.Client, auth: dict, host: str, port: int) -> None:
        """What issue 63 found cost the service before its bounds: a 30 MB msgpack array of nils, four 8 MB stop
        strings, nesting 100,000 deep, the largest forward_backward one call may hold, numbers that made NaN or a
        500, and 10,000 headers."""
        if self._trainer is None:  # a second session of its own: the first one's queue is kept full (429)
            session = http.post("/api/v1/sessions", headers=auth, json={"base_model": BASE}).json()["session_id"]
            call = http.post(f"/api/v1/sessions/{session}/calls", headers=auth,
                             json={"method": "save_weights_and_get_sampling_client"}).json()["future_id"]
            model = http.get(f"/api/v1/futures/{call}", headers=auth, params={"wait_s": 60}).json()
            self._trainer = session, model["result"]["value"]["model"]
        session, model = self._trainer
        calls = f"/api/v1/sessions/{session}/calls"
        if self._nils is None:  # (made once)
            self._nils = b"\xdd" + (30_000_000).to_bytes(4, "big") + b"\xc0" * 30_000_000
            self._stops = json.dumps({"model": self.model, "prompt": "1+1=", "max_tokens": 2,
                                      "stop": ["x" * 8_000_000] * 4}).encode()
        r = http.post(calls, headers=auth | {"Content-Type": "application/msgpack"}, content=self._nils)
        self._note("30 MB msgpack arrays of nils", r.status_code)
        r = http.post("/v1/completions", headers=auth | {"Content-Type": "application/json"}, content=self._stops)
        self._note("four 8 MB stop strings", r.status_code)
        r = http.post("/tinker/api/v1/create_model", headers=auth | {"Content-Type": "application/json"},
                      content=b"[" * 100_000 + b"]" * 100_000)
        self._note("JSON nested 100,000 deep", r.status_code)
        datums = [{"tokens": self.prompt * (256 // len(self.prompt)), "prompt_len": 1}] * 1024
        r = http.post(calls, headers=auth, json={"method": "forward_backward", "args": {"datums": datums}})
        self._note("forward_backward of 1,024 x 256 tokens", r.status_code)
        r = http.post("/api/v1/samplers/calls", headers=auth, json={"model": model, "method": "sample", "args": {
            "prompt_tokens": self.prompt, "sampling_params": {"top_p": 1e-300, "max_tokens": 4}}})
        if r.status_code == 200:  # (its result says whether it sampled)
            done = http.get(f"/api/v1/futures/{r.json()['future_id']}", headers=auth, params={"wait_s": 30}).json()
            r = SimpleNamespace(status_code="sampled" if "result" in done else done.get("error", {}).get("type"))
        self._note("top_p 1e-300", r.status_code)
        r = http.post(calls, headers=auth, json={"method": "optim_step", "args": {"params": {"learning_rate": 1e30}}})
        self._note("learning rate 1e30", r.status_code)
        self._note("10,000 headers", _raw_status(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"x-h%d: 1\r\n" % i for i in range(10_000)) + b"\r\n"))


def _raw_status(host: str, port: int, request: bytes) -> int | str:
    """The status a raw ``request`` (headers and the start of a body) is answered with."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(request)
        head = sock.recv(64).split(b" ")
    return int(head[1]) if len(head) > 1 and head[1].isdigit() else "closed"


def _load_rounds(args, url: str, process_note: str) -> None:
    from heterorl.service.client import connect

    service = connect(url, api_key=KEY)
    honest_openai = service.create_training_client(BASE, seed=0)
    honest_session = service.create_training_client(BASE, seed=1)
    abusive = service.create_training_client(BASE, seed=2)
    models = [c.save_weights_and_get_sampling_client().model for c in (honest_openai, honest_session, abusive)]
    tokenizer = honest_openai.tokenizer
    prompts = [tokenizer.encode(f"{a}+{a + 7}=") for a in range(100, 164)]
    load = dict(openai_clients=args.openai_clients, session_clients=args.session_clients, requests=args.requests,
                max_tokens=args.max_tokens)
    alone = honest_load(url, models[0], models[1], prompts, **load)
    with Abuser(url, models[2], prompts[0]) as abuser:
        attacked = honest_load(url, models[0], models[1], prompts, **load)
        health = httpx.get(f"{url}/health", timeout=10).status_code
    print(f"  {args.openai_clients} OpenAI clients (half streaming) + {args.session_clients} session-API clients, "
          f"{args.requests} requests each, {args.max_tokens} tokens{process_note}:")
    for label, result in (("alone", alone), ("with the abuser", attacked)):
        print(f"    {label:<16} p50 {result.quantile(0.5):6.2f} s | p99 {result.quantile(0.99):6.2f} s | max "
              f"{max(result.latencies, default=float('nan')):6.2f} s | {len(result.latencies)} answered, "
              f"{len(result.failures)} failed{': ' + result.failures[0] if result.failures else ''}")
    ratio = attacked.quantile(0.99) / alone.quantile(0.99)
    print(f"    p99 with the abuser / alone: {ratio:.2f}x; /health during the attack: {health}")
    print("    the abuser got: " + "; ".join(f"{what} x{n}" for what, n in sorted(abuser.got.items())))
    service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench serve-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="8,50", help="concurrent clients for requests/s (default 8,50)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each requests/s round (default 10)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8)")
    parser.add_argument("--openai-clients", type=int, default=40, help="honest OpenAI clients (default 40)")
    parser.add_argument("--session-clients", type=int, default=10, help="honest session-API clients (default 10)")
    parser.add_argument("--requests", type=int, default=10, help="requests per honest client (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the services (default 1)")
    parser.add_argument("--skip-rate", action="store_true", help="only the load with the abuser")
    args = parser.parse_args(argv)
    key_dir = tempfile.mkdtemp(prefix="heterorl-bench-load-")
    key_file = os.path.join(key_dir, "key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(KEY)
    # a budget of 2 GB: the abuser's largest forward_backward (about 20 GB counted) is refused on any machine
    common = ("--threads", str(args.threads), "--api-key-file", key_file, "--max-sessions", "8",
              "--memory-budget-mb", "2048")
    processes = {"batched": start_service(*common), "unbatched": start_service(*common, "--no-openai-batching")}
    try:
        print(f"{BASE}: heterorl serve, {args.threads} torch thread(s), this machine's {os.cpu_count()} CPUs")
        if not args.skip_rate:
            rates: dict = collections.defaultdict(list)
            models = {}
            for name, (_, url) in processes.items():
                from heterorl.service.client import connect

                models[name] = connect(url, api_key=KEY).create_training_client(
                    BASE, seed=0).save_weights_and_get_sampling_client().model
            for clients in [int(c) for c in args.clients.split(",")]:
                for name in ("unbatched", "batched", "unbatched", "batched"):  # alternate: each twice
                    url = processes[name][1]
                    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as warm:
                        warm.get("/health")
                    rates[(clients, name)].append(_completions_rate(url, models[name], clients, args.seconds,
                                                                    args.max_tokens, api_key=KEY))
                plain, batched = (statistics.mean(rates[(clients, n)]) for n in ("unbatched", "batched"))
                print(f"  /v1/completions, {clients:>3} clients, {args.max_tokens} tokens: unbatched {plain:6.1f} "
                      f"req/s | batched {batched:6.1f} req/s | batched / unbatched {batched / plain:.2f}x")
        _load_rounds(args, processes["batched"][1], "")
    finally:
        for process, _ in processes.values():
            process.terminate()
            process.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
