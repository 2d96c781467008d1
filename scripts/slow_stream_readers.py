"""Whether slow stream readers hold `heterorl serve`'s engine (docs/SERVICE.md, "Limits"): an honest 8-token
`/v1/completions` request's latency beside 20 streaming requests whose clients never read (slow), read at once
(fast), or beside none, on the tiny shipped model, in one run.

    python scripts/slow_stream_readers.py --n 16 --max-tokens 240
"""

import argparse
import json
import socket
import tempfile
import threading
import time

import httpx

from heterorl.service.server import ServerThread, create_app
from heterorl.service.sessions import Service


def stream_request(url: str, model: str, n: int, max_tokens: int, read: bool, stop: threading.Event) -> None:
    """One streaming request on a socket with a 4 KiB receive buffer, read at once (``read``) or never."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "1+2=", "n": n, "max_tokens": max_tokens, "stream": True,
                       "temperature": 1.0, "ignore_eos": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    while not stop.is_set():
        if not read:
            time.sleep(0.1)
            continue
        data = s.recv(65536)
        if not data or b"[DONE]" in data:
            break
    s.close()

def run(mode: str, url: str, model: str, n: int, max_tokens: int) -> float:
    """The honest request's seconds, beside 20 streams read as ``mode`` says (none: no streams)."""
    stop = threading.Event()
    threads = [threading.Thread(target=stream_request, args=(url, model, n, max_tokens, mode == "fast", stop))
               for _ in range(20 if mode != "none" else 0)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    with httpx.Client(base_url=url, timeout=300) as http:
        t = time.time()
        r = http.post("/v1/completions", json={"model": model, "prompt": "1+2=", "max_tokens": 8})
        latency = time.time() - t
        assert r.status_code == 200, r.text[:200]
    stop.set()
    for thread in threads:
        thread.join()
    return latency

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16, help="completions of each streaming request")
    parser.add_argument("--max-tokens", type=int, default=240, help="tokens of each streamed completion")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        service = Service(folder)
        with ServerThread(create_app(service)) as server:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                sid = http.post("/api/v1/sessions", json={"base_model": "add3-sft-base"}).json()["session_id"]
                call = http.post(f"/api/v1/sessions/{sid}/calls",
                                 json={"method": "save_weights_and_get_sampling_client"}).json()["future_id"]
                model = http.get(f"/api/v1/futures/{call}", params={"wait_s": 60}).json()["result"]["value"]["model"]
            for mode in ("none", "fast", "slow", "none"):
                seconds = run(mode, server.url, model, args.n, args.max_tokens)
                print(f"{mode:5} honest 8-token request: {seconds:.2f} s", flush=True)
        service.close()


if __name__ == "__main__":
    main()
