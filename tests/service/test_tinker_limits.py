"""The bounds of what `heterorl serve` holds for Tinker's SDK (`TinkerBook`): open sessions, silent sessions,
sampling-session names."""

import pytest

from heterorl.service.calls import TooBusy
from heterorl.service.sessions import Service
from heterorl.service.tinker import book as tinker_book


def test_open_sessions_are_bounded_and_silent_ones_are_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_book, "MAX_SESSIONS", 2)
    service = Service(tmp_path, session_ttl_s=3600, memory_budget_mb=None)
    book = tinker_book.TinkerBook(service)
    first, second = book.create_session(), book.create_session()
    with pytest.raises(TooBusy, match="2 open Tinker sessions"):
        book.create_session()
    book.finish(first)
    third = book.create_session()
    with pytest.raises(tinker_book.SessionFinished):
        book.heartbeat(first)
    book.heartbeat(third)  # (a sign of life)
    book._sessions[second].seen -= 2 * service.session_ttl_s  # (a client gone without closing: silent past the ttl)
    book.create_session()
    assert book.session(third) and book.session(second, open_only=False).finished  # (silent past the ttl)
    assert len(book.session_ids()) <= 2 * tinker_book.MAX_SESSIONS


def test_sampling_session_names_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(tinker_book, "MAX_SAMPLING_SESSIONS", 3)
    book = tinker_book.TinkerBook(Service(tmp_path, memory_budget_mb=None))
    session = book.create_session()
    for i in range(5):
        book._add_sampler(f"{session}:sample:{i}", tinker_book.SamplingSession(f"heterorl:s-x/{i}", "b", None))
    with pytest.raises(tinker_book.NotFound, match="no sampling session"):
        book.sampler(f"{session}:sample:0")  # (the oldest are forgotten)
    assert book.sampler(f"{session}:sample:4").model == "heterorl:s-x/4"
    assert book.session(session).samplers == [f"{session}:sample:{i}" for i in (2, 3, 4)]
