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


def test_a_tinker_forward_backward_is_bounded_before_any_tensor(tmp_path, monkeypatch):
    """A Tinker datum is held to the native routes' bounds before `losses.build` pads anything: the model's
    context, its token ids (an id out of range was a 500 "index out of range in self") and the tokens of one call
    (one long datum beside 1,023 short ones would have padded every input to the long one's length)."""
    import asyncio

    import numpy as np

    from heterorl.service.calls import BadRequest
    from heterorl.service.tinker import losses, protobuf
    from heterorl.service.tinker.book import TinkerBook

    service = Service(tmp_path, memory_budget_mb=None)
    book = TinkerBook(service)
    try:
        session = book.names.create_session()
        loaded = asyncio.run(service.poll(book.create_model(session, 0, "add3-sft-base", None, None), 60))
        model_id = loaded["result"]["value"]["model_id"]
        built = []
        real = losses.build
        monkeypatch.setattr(losses, "build", lambda *args: built.append(1) or real(*args))

        def datum(tokens: list[int]) -> protobuf.Datum:
            return protobuf.Datum(tokens, {"target_tokens": np.asarray([*tokens[1:], 1], dtype=np.int64),
                                           "weights": np.ones(len(tokens), dtype=np.float32)})

        for data, named in (([datum([1] * 300)], "context is 256"), ([datum([1, 2, 10**6])], "token id 1000000"),
                            ([datum([1, 2, -3])], "token id -3"), ([datum([1] * 200)] * 1400, "more than 262,144")):
            with pytest.raises(BadRequest, match=named):
                book.forward_backward(protobuf.ForwardBackwardRequest(model_id, 1, data, "cross_entropy"))
        assert built == []
        done = asyncio.run(service.poll(book.forward_backward(
            protobuf.ForwardBackwardRequest(model_id, 2, [datum([1, 2, 3])], "cross_entropy")), 60))
        assert done["status"] == "done" and "error" not in done and built == [1], done
    finally:
        service.close()
