"""How the OpenAI-compatible endpoint generates (`heterorl.service.openai_api` is its HTTP side): completions built
token by token as the engine draws them (`ChoiceBuilder`: incremental detokenizing, stop strings, what a stream
may send), and concurrent requests to one sampling client batched into one engine call, each cancellable
(`RequestBatcher`, `Generation`).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Callable

from heterorl.engines.base import STOP_LENGTH, GenerationCancelled, GenerationWatch, SampleOutput, SamplingParams
from heterorl.training.session import SamplingClient

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a log-prob below this is reported as this
DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before a completion's first token (a leading space depends on them)
MAX_BATCH_CHOICES = 1024  # completions (prompts x n) of several requests generated in one engine call, at most


@dataclass
class Choice:
    """One completion as answered: ``text`` cut before the first stop string, ``tokens`` through the token that
    ended it (the end-of-sequence token, or the one that completed the stop string), with their log-probs,
    their own texts (special tokens shown), where each one's text starts in the completion before the stop string
    was cut, and each one's part of ``text`` (the stream's chunks; they concatenate to ``text``)."""

    text: str = ""
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    shares: list[str] = field(default_factory=list)


class ChoiceBuilder:
    """A completion built from its tokens one at a time, as a streaming engine checks it: each token is decoded
    incrementally as vLLM does (after the few before it, so that a leading space or a character split over byte
    tokens comes out as the whole sequence's decode has it; a token that ends inside a character adds nothing
    until the one that completes it), and the text is checked for the stop strings after each token. The first
    stop string completed cuts the text before it and ends the completion: later tokens are not part of it.

    `add` and `close` return how many tokens are *settled*: their share of the final text can no longer change,
    because no stop string can begin inside them (the end of the text that could still start one is held back).
    A stream sends a token once it is settled."""

    def __init__(self, tokenizer, prompt: list[int], stops: list[str], token_ids: bool) -> None:
        self.tokenizer, self.stops, self.token_ids = tokenizer, [s for s in stops if s], token_ids
        self._ids = list(prompt[-DETOKENIZE_CONTEXT:]) if DETOKENIZE_CONTEXT else []
        self._prefix, self._read = 0, len(self._ids)
        self._before = self._decode(self._prefix, self._read)
        self._full = ""  # the decoded completion so far, before any stop string is cut
        self._ends: list[int] = []  # where each token's piece ends in _full
        self._cut: int | None = None  # where the stop string found begins
        self.choice = Choice()
        self.settled = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the completion: later tokens are dropped."""
        return self._cut is not None

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def add(self, token: int, logprob: float) -> int:
        """Take the next token the engine drew; the number of settled tokens."""
        if self.stopped or self.choice.finish_reason is not None:
            return self.settled
        self._ids.append(int(token))
        after = self._decode(self._prefix, len(self._ids))
        piece = ""
        if len(after) > len(self._before) and not after.endswith("\ufffd"):
            piece = after[len(self._before):]
            self._prefix, self._read = self._read, len(self._ids)
            self._before = self._decode(self._prefix, self._read)
        start = len(self._full)
        self._full += piece
        self._ends.append(len(self._full))
        choice = self.choice
        choice.tokens.append(int(token))
        choice.logprobs.append(max(float(logprob), LOGPROB_FLOOR))
        choice.token_texts.append(f"token_id:{token}" if self.token_ids else
                                  self.tokenizer.decode([int(token)], skip_special_tokens=False))
        choice.text_offsets.append(start)
        if piece:
            self._find_stop(start)
        return self._settle(len(self._full) - self._held())

    def _find_stop(self, start: int) -> None:
        """Cut at the stop string this token completed first (none was complete before it: any one found ends
        in this token's piece)."""
        found = []
        for stop in self.stops:
            at = self._full.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                found.append((at + len(stop), at))
        if found:
            self._cut = min(found)[1]

    def _held(self) -> int:
        """How many characters at the end of the text could still begin a stop string."""
        if self.stopped:
            return 0
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._full)), held, -1):
                if self._full.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _settle(self, upto: int) -> int:
        """Settle every token whose piece ends at or before ``upto`` (all of them once the text is cut)."""
        text = self._full if self._cut is None else self._full[:self._cut]
        ends = self._ends
        while self.settled < len(ends) and (self.stopped or ends[self.settled] <= upto):
            i = self.settled
            start = self.choice.text_offsets[i]
            self.choice.shares.append(text[min(start, len(text)):min(ends[i], len(text))])
            self.settled += 1
        self.choice.text = text
        if self.stopped:
            self.choice.finish_reason = "stop"
        return self.settled

    def close(self, stop_reason: str) -> int:
        """The engine ended the completion (``stop_reason``, `SampleOutput.stop_reason`): settle every token."""
        settled = self._settle(len(self._full))
        if self.choice.finish_reason is None:
            self.choice.finish_reason = "length" if stop_reason == STOP_LENGTH else "stop"
        return settled


def finish(tokenizer, prompt: list[int], sample: SampleOutput, stops: list[str], token_ids: bool) -> Choice:
    """The answer for a whole ``sample``: cut at the stop string completed first (the one a check after each token
    finds first), finish_reason "stop" for a stop string, an end-of-sequence or stop token, "length" otherwise."""
    builder = ChoiceBuilder(tokenizer, prompt, stops, token_ids)
    for token, logprob in zip(sample.tokens, sample.logprobs):
        builder.add(token, logprob)
    builder.close(sample.stop_reason)
    return builder.choice


def finish_all(tokenizer, prompts, groups, stops: list[str], token_ids: bool) -> list[Choice]:
    return [finish(tokenizer, prompt, sample, stops, token_ids) for prompt, group in zip(prompts, groups)
            for sample in group]


# -- one request's generation, and batches of them -----------------------------------------------------------------
class Generation:
    """One request's completions (``n`` per prompt, prompt-major), generated alone or in a batch with others.

    Streamed (``stream``): each completion is built as its tokens are drawn (`ChoiceBuilder`, on the generating
    thread) and `events` yields (choice index, token index) for each token once it is settled, then (index, None)
    when a completion is finished. Not streamed, the completions are built once the generation is done."""

    def __init__(self, prompts: list[list[int]], n: int, params: SamplingParams, *, tokenizer, stops: list[str],
                 token_ids: bool, stream: bool) -> None:
        self.prompts, self.n, self.params, self.stream = prompts, n, params, stream
        self.tokenizer, self.stops, self.token_ids = tokenizer, stops, token_ids
        self.rows = len(prompts) * n
        self.builders = ([ChoiceBuilder(tokenizer, prompts[r // n], stops, token_ids) for r in range(self.rows)]
                         if stream else [])
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future = self._loop.create_future()
        self._events: asyncio.Queue = asyncio.Queue()
        self._sent = [0] * (self.rows if stream else 0)
        self._batch: _Batch | None = None

    @property
    def version(self) -> int | None:
        """The policy version that generates this request (None until its engine call started)."""
        return None if self._batch is None else self._batch.watch.version

    @property
    def key(self) -> tuple | None:
        """Requests with the same key may share an engine call; None: this one runs alone (a seeded request: its
        completions must not depend on what it was batched with)."""
        if self.params.seed is not None:
            return None
        return (self.n, self.params)

    # (on the generating thread)
    def tokens(self, rows: list[int], tokens: list[int], logprobs: list[float]) -> None:
        """The tokens this request's ``rows`` drew in one decode step."""
        if not self.stream or self.cancelled:
            return
        ready = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            settled = self.builders[row].add(token, logprob)
            if settled > self._sent[row]:
                ready.append((row, self._sent[row], settled))
                self._sent[row] = settled
        if ready:
            _call_soon(self._loop, self._queue_tokens, ready)

    def _queue_tokens(self, ready) -> None:
        for row, start, end in ready:
            for i in range(start, end):
                self._events.put_nowait((row, i))

    # (on the event loop)
    def _finished(self, groups: list[list[SampleOutput]] | None, error: BaseException | None) -> None:
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
            self._events.put_nowait(error)
            return
        if self.stream:
            for row, sample in enumerate(s for group in groups for s in group):
                settled = self.builders[row].close(sample.stop_reason)
                self._queue_tokens([(row, self._sent[row], settled)])
                self._sent[row] = settled
                self._events.put_nowait((row, None))
        self._done.set_result(groups)
        self._events.put_nowait(None)

    async def result(self) -> list[list[SampleOutput]]:
        """Each prompt's ``n`` samples, once the generation is done."""
        return await asyncio.shield(self._done)

    async def events(self):
        """(choice index, token index) for each settled token, (choice index, None) once a completion is
        finished; then the end. A failed generation raises its error."""
        while True:
            event = await self._events.get()
            if event is None:
                return
            if isinstance(event, BaseException):
                raise event
            yield event

    def cancel(self) -> None:
        """The client went away: drop this request; its engine call stops between decode steps once no other
        request shares it (a request still waiting for the engine is never started)."""
        if self.cancelled:
            return
        self.cancelled = True
        if self._batch is not None:
            self._batch.member_cancelled()
        if not self._done.done():
            self._done.set_exception(GenerationCancelled("the request was cancelled (its client went away)"))
            self._done.exception()  # (retrieved: nobody may await it now)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing once the loop is closed (the server stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class _Batch:
    """Requests generated in one engine call: their prompts concatenated (same ``n`` and parameters), each
    request's rows a contiguous range of the call's."""

    def __init__(self, members: list[Generation]) -> None:
        self.members = members
        self.offsets, start = [], 0
        for member in members:
            self.offsets.append(start)
            start += member.rows
        self.watch = GenerationWatch(self._tokens)
        for member in members:
            member._batch = self

    def _tokens(self, rows: list[int], tokens: list[int], logprobs: list[float]) -> None:
        for member, offset in zip(self.members, self.offsets):
            picked = [(r - offset, t, lp) for r, t, lp in zip(rows, tokens, logprobs)
                      if offset <= r < offset + member.rows]
            if picked:
                member.tokens(*map(list, zip(*picked)))

    def member_cancelled(self) -> None:
        if all(member.cancelled for member in self.members):
            self.watch.cancel()

    def finished(self, groups, error) -> None:
        start = 0
        for member in self.members:
            count = len(member.prompts)
            member._finished(None if groups is None else groups[start:start + count], error)
            start += count


class RequestBatcher:
    """Feeds one sampling client's requests to its engine: while a call runs, the requests that arrive wait, and
    the next call takes the oldest with every waiting request that can share it (same ``n`` and parameters, no
    seed, up to MAX_BATCH_CHOICES completions). ``batching`` False: one request per call."""

    def __init__(self, client: SamplingClient, *, batching: bool = True,
                 on_closed: Callable[[RuntimeError], BaseException] | None = None) -> None:
        # (a weak reference: the router keys its batchers by client weakly, and a closed model must be freed)
        self._client = weakref.ref(client)
        self.batching, self.on_closed = batching, on_closed
        self._waiting: list[Generation] = []
        self._running = False

    def submit(self, generation: Generation) -> None:
        self._waiting.append(generation)
        self._next()

    def _next(self) -> None:
        self._waiting = [g for g in self._waiting if not g.cancelled]
        if self._running or not self._waiting:
            return
        first = self._waiting.pop(0)
        members, rows = [first], first.rows
        if self.batching and first.key is not None:
            for other in list(self._waiting):
                if other.key == first.key and rows + other.rows <= MAX_BATCH_CHOICES:
                    members.append(other)
                    rows += other.rows
                    self._waiting.remove(other)
        batch = _Batch(members)
        prompts = [p for member in members for p in member.prompts]
        client = self._client()
        try:
            if client is None:
                raise RuntimeError("the sampling client is gone")
            future = client.sample(prompts, first.n, first.params, watch=batch.watch)
        except RuntimeError as exc:  # the client's thread was shut down: the model was closed meanwhile
            batch.finished(None, self.on_closed(exc) if self.on_closed else exc)
            self._next()
            return
        self._running = True
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda f: _call_soon(loop, self._done, batch, f))

    def _done(self, batch: _Batch, future) -> None:
        self._running = False
        error = GenerationCancelled("the generation was cancelled") if future.cancelled() else future.exception()
        batch.finished(None if error is not None else future.result(), error)
        self._next()


__all__ = ["Choice", "ChoiceBuilder", "Generation", "RequestBatcher", "finish", "finish_all"]
