"""The bounds of the names `heterorl serve` holds for Tinker's SDK (`TinkerNames`): open sessions, silent
sessions, sampling-session names."""

import pytest

from heterorl.service.calls import NotFound, TooBusy
from heterorl.service.sessions import Service
from heterorl.service.tinker import names as tinker_names


def test_open_sessions_are_bounded_and_silent_ones_are_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_names, "MAX_SESSIONS", 2)
    service = Service(tmp_path, session_ttl_s=3600, memory_budget_mb=None)
    names = tinker_names.TinkerNames(service)
    first, second = names.create_session(), names.create_session()
    with pytest.raises(TooBusy, match="2 open Tinker sessions"):
        names.create_session()
    names.finish(first)
    third = names.create_session()
    with pytest.raises(tinker_names.SessionFinished):
        names.heartbeat(first)
    names.heartbeat(third)  # (a sign of life)
    names._sessions[second].seen -= 2 * service.session_ttl_s  # (a client gone without closing: silent past the ttl)
    names.create_session()
    assert names.session(third) and names.session(second, open_only=False).finished  # (silent past the ttl)
    assert len(names.session_ids()) <= 2 * tinker_names.MAX_SESSIONS


def test_sampling_session_names_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_names, "MAX_SAMPLING_SESSIONS", 3)
    names = tinker_names.TinkerNames(Service(tmp_path, memory_budget_mb=None))
    session = names.create_session()
    for i in range(5):
        names.add_sampler(f"{session}:sample:{i}", tinker_names.SamplingSession(f"heterorl:s-x/{i}", "b", None))
    with pytest.raises(NotFound, match="no sampling session"):
        names.sampler(f"{session}:sample:0")  # (the oldest are forgotten)
    assert names.sampler(f"{session}:sample:4").model == "heterorl:s-x/4"
    assert names.session(session).samplers == [f"{session}:sample:{i}" for i in (2, 3, 4)]
