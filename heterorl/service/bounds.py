"""What one call to the service may ask, checked from its arguments' sizes and values alone, before anything is
tokenized, allocated, generated or trained (docs/SERVICE.md, "Refusals"): a `BadRequest` naming the bound and the
fix otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heterorl.engines.base import SamplingParams
from heterorl.service.calls import BadRequest

if TYPE_CHECKING:
    from heterorl.training.session import TrainingClient

MAX_REQUEST_TOKENS = 1 << 18  # prompts x samples x max_tokens of one sampling call: what it may generate
MAX_PROMPT_TOKENS = 1 << 20  # every prompt token of one sampling or log-prob call, together
MAX_TRAINING_TOKENS = 1 << 18  # every token of the datums of one forward or forward_backward call, together
MAX_STOP_STRINGS = 16  # stop strings of one sampling call (the OpenAI routes take 4, as OpenAI's API does)
MAX_STOP_BYTES = 1024  # UTF-8 bytes of one stop string
MAX_STOP_TOKEN_IDS = 256  # stop token ids of one sampling call
MAX_BODY_ELEMENTS = MAX_PROMPT_TOKENS  # entries of one array or map of a msgpack body (its whole size is bounded too)
ERROR_EXCERPT = 200  # characters of a refused value an error body quotes, at most
MAX_ERRORS_SHOWN = 10  # fields an error body names, at most

DATUM_FIELDS = ("tokens", "prompt_len", "advantage", "reward", "group_id", "behaviour_logprobs", "policy_versions",
                "weights")


def check_training_size(method: str, args: dict, training: TrainingClient,
                         max_tokens: int = MAX_TRAINING_TOKENS) -> None:
    """`BadRequest` for a forward or forward_backward call the session cannot take, from its arguments' sizes and
    values alone, before any tensor is made: at most ``max_tokens`` tokens in all, each datum within the model's
    context, its token ids within its vocabulary, its per-token lists no longer than its tokens."""
    datums = args.get("datums")
    if not isinstance(datums, list) or not datums:
        raise BadRequest(f"{method}: datums must be a non-empty list of datums ({{tokens, prompt_len, ...}})")
    if 2 * len(datums) > max_tokens:  # (a datum holds 2 tokens at least)
        raise BadRequest(f"{method}: {len(datums):,} datums in one call; this service takes at most {max_tokens:,} "
                         "tokens of datums per call: split it into smaller calls")
    config = getattr(training.model, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    vocab = training.model.get_input_embeddings().num_embeddings
    total = 0
    for i, datum in enumerate(datums):
        tokens = datum.get("tokens") if isinstance(datum, dict) else None
        if not isinstance(tokens, list):
            raise BadRequest(f"{method}: datum {i} must be a mapping with a list of token ids under 'tokens'")
        unknown = sorted(set(datum) - set(DATUM_FIELDS))
        if unknown:
            raise BadRequest(f"{method}: datum {i} has unknown field(s) {', '.join(map(str, unknown))[:200]}; a "
                             f"datum's fields are {', '.join(DATUM_FIELDS)}")
        if context is not None and len(tokens) > context:
            raise BadRequest(f"{method}: datum {i} has {len(tokens):,} tokens; this model's context is {context:,} "
                             "(prompt and completion together): shorten it")
        total += len(tokens)
        if total > max_tokens:
            raise BadRequest(f"{method}: more than {max_tokens:,} tokens of datums in one call (datum {i} passes "
                             "it): split it into smaller calls")
        bad = next((t for t in tokens if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"{method}: datum {i} holds token id {str(bad)[:40]}; this model's ids are integers "
                             f"in [0, {vocab:,})")
        for name in ("behaviour_logprobs", "policy_versions", "weights"):
            values = datum.get(name)
            if values is not None and (not isinstance(values, list) or len(values) > len(tokens)):
                raise BadRequest(f"{method}: datum {i}'s {name} must be a list of at most its {len(tokens):,} tokens' "
                                 "length (one entry per completion token)")


def check_sampling_size(method: str, args: dict, max_tokens_out: int) -> None:
    """`BadRequest` for a sampling call bigger than the service takes, from its arguments' sizes alone (before any
    tokenization, allocation or generation)."""
    key = "prompt_tokens" if method == "sample" else "tokens"
    prompts = args.get(key)
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest(f"{method}: {key} must be a list of token ids, or a list of such lists")
    groups = prompts if isinstance(prompts[0], list) else [prompts]
    given = sum(len(p) if isinstance(p, list) else 1 for p in groups)
    if given > MAX_PROMPT_TOKENS:
        raise BadRequest(f"{method}: {given:,} prompt tokens in one call; this service takes at most "
                         f"{MAX_PROMPT_TOKENS:,}: send fewer or shorter prompts")
    if method != "sample":
        return
    samples, params = args.get("num_samples", 1), args.get("sampling_params") or {}
    length = params.get("max_tokens", SamplingParams().max_tokens) if isinstance(params, dict) else None
    if type(samples) is not int or samples < 1 or type(length) is not int or length < 1:
        raise BadRequest(f"sample: num_samples ({samples!r}) and sampling_params.max_tokens ({length!r}) must be "
                         "integers >= 1")
    seed = params.get("seed") if isinstance(params, dict) else None
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise BadRequest(f"sample: sampling_params.seed={seed!r}: give an integer in [0, 2**63)")
    asked = len(groups) * samples * length
    if asked > max_tokens_out:
        raise BadRequest(f"sample: {len(groups)} prompts x {samples} samples x {length} max_tokens = {asked:,} "
                         f"tokens; one call generates at most {max_tokens_out:,} here: split it into smaller calls")


def check_stops(where: str, stops: list, stop_ids: list | tuple = (), max_strings: int = MAX_STOP_STRINGS) -> None:
    """`BadRequest` for stop strings or stop token ids beyond what one call may give (`MAX_STOP_STRINGS` strings
    of `MAX_STOP_BYTES` bytes, `MAX_STOP_TOKEN_IDS` ids), before any is encoded or searched for."""
    if len(stops) > max_strings:
        raise BadRequest(f"{where}: {len(stops):,} stop strings; at most {max_strings} are taken")
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_BYTES or len(stop.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise BadRequest(f"{where}: stop string {i} is longer than {MAX_STOP_BYTES:,} bytes; give a shorter "
                             "one (a stop string is searched for in every sample's text)")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"{where}: {len(stop_ids):,} stop token ids; at most {MAX_STOP_TOKEN_IDS} are taken")


def excerpt(value, limit: int = ERROR_EXCERPT) -> str:
    """A bounded excerpt of ``value`` for an error message: its repr, cut at ``limit`` characters, made without
    walking more of a large container than it shows."""
    import reprlib

    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxtuple = 3, 8, 8, 8
    shown.maxstring = shown.maxother = limit
    text = shown.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bounded_errors(errors) -> list[dict]:
    """A validation error's field errors, as an error body may carry them: at most `MAX_ERRORS_SHOWN`, each with
    its location, message and type, and an excerpt of the value it refused (never the value itself: a refused
    30 MB array was echoed whole, a 143 MB answer)."""
    shown = []
    for error in list(errors)[:MAX_ERRORS_SHOWN]:
        entry = {"loc": [str(part)[:64] for part in error.get("loc", ())][:8], "msg": str(error.get("msg", ""))[:300],
                 "type": str(error.get("type", ""))[:64]}
        if "input" in error:
            entry["input"] = excerpt(error["input"], 80)
        shown.append(entry)
    return shown
