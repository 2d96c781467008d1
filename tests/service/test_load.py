"""`heterorl serve` under 50 honest clients (OpenAI, streaming or not, and the session API) while one client abuses
it, run as `heterorl bench serve-load` runs it (two real `heterorl serve` processes, batched and not): every honest
request is answered in full, and each kind of abuse gets its refusal. (What the latencies and rates were is the
benchmark's to report: a test asserts nothing that depends on timing.)"""

import re

from tests.conftest import run_cli


def test_fifty_honest_clients_are_all_answered_while_one_client_abuses_the_service():
    out = run_cli("bench", "serve-load", "--clients", "2", "--seconds", "0.5", "--openai-clients", "40",
                  "--session-clients", "10", "--requests", "1", "--max-tokens", "6")
    assert out.returncode == 0, out.stdout + out.stderr
    assert float(out.stdout.split("batched / unbatched ")[1].split("x")[0]) > 0  # both services answered
    rounds = [line for line in out.stdout.splitlines() if line.startswith(("    alone", "    with the abuser "))]
    assert len(rounds) == 2 and all("50 answered, 0 failed" in line for line in rounds), out.stdout
    assert "/health during the attack: 200" in out.stdout
    got = {what.strip(): status for what, status in re.findall(r"([^;:]+): (\w+) x\d+",
                                                               out.stdout.split("the abuser got: ")[1])}
    assert got["declared 200 MB bodies"] == "413"
    assert got["malformed JSON"] == got["300,000-character prompts"] == "400"
    assert got["requests without the key"] == "401"
    assert "max-size sample calls: 429" in out.stdout  # its session's queue filled, then refused
    assert "half-sent headers: held x100" in out.stdout
