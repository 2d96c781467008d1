"""A `heterorl serve` process under 50 honest clients (OpenAI, streaming or not, and the session API) while one
client abuses it: every honest request is answered in full, and each kind of abuse gets its refusal. (What the
latencies were is `heterorl bench serve-load`'s to measure: a test asserts nothing that depends on timing.)"""

import os

import httpx

from heterorl.bench.service import BASE, start_service
from heterorl.bench.service_load import KEY, Abuser, honest_load
from heterorl.service.client import connect


def test_fifty_honest_clients_are_all_answered_while_one_client_abuses_the_service(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    os.chmod(key_file, 0o600)
    process, url = start_service("--threads", "1", "--api-key-file", str(key_file), state_dir=str(tmp_path))
    try:
        service = connect(url, api_key=KEY)
        sessions = [service.create_training_client(BASE, seed=s) for s in range(3)]
        models = [c.save_weights_and_get_sampling_client().model for c in sessions]
        prompts = [sessions[0].tokenizer.encode(f"{a}+{a + 7}=") for a in range(100, 132)]
        with Abuser(url, models[2], prompts[0], slow_connections=50) as abuser:
            result = honest_load(url, models[0], models[1], prompts, openai_clients=40, session_clients=10,
                                 requests=2, max_tokens=6)
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert result.failures == [] and len(result.latencies) == 100
        got = {what.rsplit(": ", 1)[0]: status for what, _ in abuser.got.items()
               for status in [what.rsplit(": ", 1)[1]]}
        assert got["declared 200 MB bodies"] == "413"
        assert got["malformed JSON"] == got["300,000-character prompts"] == "400"
        assert got["requests without the key"] == "401"
        assert abuser.got["max-size sample calls: 429"] >= 1  # its session's queue filled, then refused
        assert abuser.got["half-sent headers: held"] == 50
        service.close()
    finally:
        process.terminate()
        process.wait(30)
    assert process.returncode == 0, open(tmp_path / "serve.log").read()[-3000:]
