"""One optimisation step on a batch of whole groups: minibatches of whole groups, skipping those without
signal, each through ``forward_backward`` + ``optim_step``. Shared by every RL loop (the synchronous loop,
the learner, the simulated execution)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

import torch

from gepo import LossBatch, LossInputError
from heterorl.config import Config
from heterorl.errors import HeteroRLError
from heterorl.training.lr_schedule import learning_rate
from heterorl.training.session import AdamParams, Datum, TrainingClient, resolve_loss

log = logging.getLogger("heterorl.training.step")


def group_rows(datums: list[Datum]) -> list[list[Datum]]:
    """The datums of each group, in order of first appearance."""
    groups: dict[int, list[Datum]] = {}
    for d in datums:
        groups.setdefault(d.group_id, []).append(d)
    return list(groups.values())


def has_signal(groups: list[list[Datum]]) -> bool:
    """Whether some group's rewards differ: if none do, every group-relative advantage is 0."""
    return any(len({d.reward for d in group}) > 1 for group in groups)


def minibatches(datums: list[Datum], count: int) -> list[list[Datum]]:
    """Split into ``count`` minibatches of whole groups (groups are contiguous in ``datums``)."""
    ordered = group_rows(datums)
    size = max(1, -(-len(ordered) // count))
    return [[d for g in ordered[i:i + size] for d in g] for i in range(0, len(ordered), size)]


# ``optim/skip_reason`` of a step that ran no update (``optim/updates`` 0)
NO_SIGNAL = "no_signal"  # every group's completions scored alike: every group-relative advantage is 0
TOO_FEW_GROUPS = "too_few_groups"  # fewer groups with signal in each minibatch than learner ranks
# every minibatch that had signal was skipped: the loss refused it (`gepo.LossInputError`: e.g. not finite) or its
# gradient norm was not finite
BAD_BATCH = "bad_batch"


@dataclass
class SkippedUpdate:
    """Rows no update learned from: a minibatch the loss refused (`gepo.LossInputError`) or whose gradient was not
    finite, or groups a bound dropped from a minibatch that trained (`bounded`)."""

    rows: list[int]  # its datums, as indices into the datums given to `optimize_batch`
    reason: str  # the loss's message, or the bound's


@dataclass
class DroppedGroups:
    """Groups `bounded` took out of a minibatch before its loss, and why."""

    group_ids: list[int]
    reason: str


def _rows(batch: LossBatch, keep: torch.Tensor) -> LossBatch:
    """``batch`` restricted to the rows where ``keep``; the learner's log-probs keep their gradient."""
    values = {f.name: getattr(batch, f.name) for f in fields(batch) if f.init}
    return LossBatch(**{name: value[keep] if isinstance(value, torch.Tensor) else value
                        for name, value in values.items()})


def bounded(loss_fn, max_log_ratio: float | None, max_abs_reward: float | None, dropped: list[DroppedGroups]):
    """``loss_fn`` on the minibatch without the groups that break a bound (docs/RELIABILITY.md, "Bounds on one
    group"): a completion token whose |log p − log q| > ``max_log_ratio`` (its importance weight beyond
    e^±max_log_ratio), or a row whose |reward| > ``max_abs_reward``; None: no such bound. The learner's log-probs
    are those of this forward, so the check costs no extra pass. Each call appends what it dropped to
    ``dropped``; when it would drop every group it raises `gepo.LossInputError` instead (no loss, no update)."""
    def loss(batch: LossBatch, config):
        over = torch.zeros(batch.logprobs.shape[0], dtype=torch.bool, device=batch.logprobs.device)
        reasons = []
        if max_log_ratio is not None and batch.behaviour_logprobs is not None:
            delta = (batch.token("logprobs") - batch.token("behaviour_logprobs")).detach().abs()  # padding: 0
            far = (delta > max_log_ratio).any(-1)
            if bool(far.any()):
                reasons.append(f"|log p − log q| up to {float(delta[far].max()):.4g} > rl.max_log_ratio = "
                               f"{max_log_ratio:g}")
            over |= far
        if max_abs_reward is not None and batch.rewards is not None:
            far = batch.rewards.abs() > max_abs_reward
            if bool(far.any()):
                reasons.append(f"|reward| up to {float(batch.rewards[far].abs().max()):.4g} > rl.max_abs_reward = "
                               f"{max_abs_reward:g}")
            over |= far
        if not bool(over.any()):
            return loss_fn(batch, config)
        ids = batch.group_ids if batch.group_ids is not None else torch.zeros_like(over, dtype=torch.long)
        out = torch.isin(ids, ids[over])  # every row of a group with one row over a bound
        dropped.append(DroppedGroups(sorted(set(ids[over].tolist())), "; ".join(reasons)))
        if bool(out.all()):
            raise LossInputError(f"every group of this minibatch breaks a bound on one group's weight: "
                                 f"{'; '.join(reasons)}")
        return loss_fn(_rows(batch, ~out), config)

    return loss


@dataclass
class CappedGroups:
    """Groups `capped` scaled down in a minibatch's gradient: their effective weights before the cap."""

    group_ids: list[int]
    weights: list[float]


def group_weights(loss_fn, batch: LossBatch, config, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(group index of each row, each group's id, its effective importance weight, the loss's coefficients).

    The loss's gradient reaches the model only through the learner's log-probs: ∇θ L = Σ_t c_t ∇θ log p_t with
    c = ∂L/∂log p, the loss's coefficients (autograd through the loss alone, not the model). A group's coefficient
    mass is Σ |c_t| over its completion tokens; its effective weight is that mass over the mass the same group has
    when its log-probs are the behaviour policy's (every ratio 1: on-policy). It is 1 on-policy, whatever the loss,
    the advantages or the lengths; NaN for a group with no mass on-policy (nothing to scale)."""
    (coef,) = torch.autograd.grad(value, batch.logprobs, retain_graph=True, allow_unused=True)
    ids = batch.group_ids if batch.group_ids is not None else torch.zeros(len(batch.logprobs), dtype=torch.long,
                                                                           device=batch.logprobs.device)
    group_ids, rows = torch.unique(ids, return_inverse=True)
    if coef is None:  # a loss that does not read the learner's log-probs: nothing it could weigh
        return rows, group_ids, torch.full((len(group_ids),), float("nan"), dtype=torch.float64), None
    behaviour = batch.behaviour_logprobs.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        on_policy, _ = loss_fn(replace(batch, logprobs=behaviour), config)
        (coef0,) = torch.autograd.grad(on_policy, behaviour, allow_unused=True)
    mass = torch.zeros(len(group_ids), dtype=torch.float64, device=coef.device)
    mass.index_add_(0, rows.to(coef.device), coef.detach().abs().sum(-1).double())
    mass0 = torch.zeros_like(mass)
    if coef0 is not None:
        mass0.index_add_(0, rows.to(coef0.device), coef0.abs().sum(-1).double())
    weight = torch.where(mass0 > 0, mass / mass0.clamp(min=1e-300), torch.full_like(mass, float("nan")))
    return rows, group_ids, weight, coef.detach()


def capped(loss_fn, max_group_weight: float | None, capped_groups: list[CappedGroups], seen: list[float]):
    """``loss_fn`` whose gradient gives no group an effective importance weight above ``max_group_weight``
    (`group_weights`; docs/RELIABILITY.md, "Bounds on one group"): a group over it has its coefficients scaled by
    max_group_weight / its weight, so its gradient is the one it would make with that weight, its direction kept
    (group-level truncated importance sampling, as TIS truncates a token's weight and dual-clip PPO a negative
    advantage's ratio). The loss's value is unchanged; only its gradient is. None: no cap. Each call appends the
    groups it scaled to ``capped_groups`` and the largest weight it measured to ``seen``. Only where the learner's
    log-probs carry a gradient and the batch has behaviour log-probs (an RL loss on sampled data)."""
    def loss(batch: LossBatch, config):
        value, metrics = loss_fn(batch, config)
        if max_group_weight is None or batch.behaviour_logprobs is None or not batch.logprobs.requires_grad:
            return value, metrics
        rows, group_ids, weight, coef = group_weights(loss_fn, batch, config, value)
        measured = weight[~weight.isnan()]
        if len(measured):
            seen.append(float(measured.max()))
        over = weight > max_group_weight  # (NaN, as for a loss that does not read the log-probs: not over)
        if not bool(over.any()):
            return value, metrics
        capped_groups.append(CappedGroups(group_ids[over].tolist(), weight[over].tolist()))
        scale = torch.where(over, max_group_weight / weight, torch.ones_like(weight))[rows.to(weight.device)]
        # a surrogate with the loss's value and the gradient Σ_t scale · c_t ∇log p_t (built from the scaled
        # coefficients, not as the loss's gradient plus a correction: at a weight of e^40 that sum cancels in float32)
        surrogate = ((scale[:, None].to(coef) * coef) * batch.token("logprobs")).sum()
        return value.detach() + (surrogate - surrogate.detach()), metrics  # (x − x: exactly 0)

    return loss


def refused_on_any_rank(loss_fn, rank: int, world: int):
    """``loss_fn`` for rank ``rank`` of ``world`` data-parallel ranks: it refuses (`gepo.LossInputError`) on every
    rank when it refuses on any. The ranks agree by one all-reduce of a (world,) flag vector after the loss and
    before ``backward``: a rank that went on into ``backward`` alone would wait forever in DDP's gradient
    all-reduce for the rank that refused."""
    def agreed(batch, config):
        refused, out = None, None
        try:
            out = loss_fn(batch, config)
        except LossInputError as exc:
            refused = exc
        flags = torch.zeros(world, device=batch.logprobs.device)  # on the model's device: NCCL needs it there
        flags[rank] = refused is not None
        torch.distributed.all_reduce(flags)  # the sum of one-hot flags: which ranks refused
        if refused is not None:
            raise refused
        if flags.any():
            others = flags.nonzero().flatten().tolist()
            raise LossInputError(f"learner rank(s) {others} refused their share of this minibatch (their log says "
                                 "why), so every rank skips it")
        return out

    return agreed


def optimize_batch(training: TrainingClient, datums: list[Datum], cfg: Config, total_updates: int,
                   shard: tuple[int, int] = (0, 1), skipped: list[SkippedUpdate] | None = None,
                   fresh_logprobs: dict[int, list[float]] | None = None) -> dict:
    """``forward_backward`` + ``optim_step`` on ``cfg.rl.updates_per_batch`` minibatches of whole groups.

    A minibatch in which every group scored alike carries no learning signal and is skipped; with
    ``cfg.rl.drop_uniform_groups`` such groups are dropped from every minibatch first. Returns the
    metrics of the last update (the loss's diagnostics, ``optim/lr``, ``optim/grad_norm``) and
    ``optim/updates`` (how many updates ran). A step that ran no update has no loss, so it reports none of
    the loss's metrics (``loss/*``, ``is/*``, ``kl/*``) nor ``optim/lr``/``optim/grad_norm``: by design they
    are absent, not NaN, and ``optim/skip_reason`` says why (`NO_SIGNAL`, `TOO_FEW_GROUPS` or `BAD_BATCH`).

    A group that breaks a bound on one group's weight (``cfg.rl.max_log_ratio``, ``cfg.rl.max_abs_reward``:
    `bounded`) is dropped from its minibatch before the loss, which trains on the rest; ``optim/dropped_groups``
    (present only when > 0) counts them and a warning says why. A group whose effective importance weight exceeds
    ``cfg.rl.max_group_weight`` has its gradient scaled down to that weight (`capped`); ``optim/capped_groups``
    (present only when > 0) counts them, ``optim/group_weight_max`` is the largest weight measured. A minibatch
    whose loss raises ``gepo.LossInputError`` (a non-finite loss, inconsistent input, every group dropped), or whose
    gradient norm is not finite, is skipped without a step and logged; ``optim/bad_batches`` (present only when > 0)
    counts them. ``skipped``, when given, receives a `SkippedUpdate` for each skipped minibatch and for the dropped
    groups of each minibatch that trained, so the caller can keep their rows.

    ``fresh_logprobs``, when given, receives {row: the learner's log-probs of its completion tokens} for the rows
    this rank forwarded before the first ``optim_step``, i.e. under the weights the batch started from (the
    learner compares them with the workers' behaviour log-probs: `heterorl.runtime.engine_stats`). A step that
    ran no update forwards its first minibatch (no gradient) for them, so every step measures the mismatch.

    ``shard = (rank, world)``: under data parallelism every rank is given the whole batch, makes the same
    minibatch and skip decisions, and runs ``forward_backward`` on its share of each minibatch's groups
    (groups rank, rank + world, ...); the gradient all-reduce in ``backward`` averages the shares. A minibatch
    the loss refuses on any rank is skipped on every rank (`refused_on_any_rank`), and its `SkippedUpdate`
    holds all of its rows, so the ranks keep identical weights and none waits for another. Groups are dropped by
    the rank whose share holds them, which counts them and writes them down.
    """
    rank, world = shard
    metrics: dict = {"optim/updates": 0}
    reason = NO_SIGNAL
    row_of = {id(d): i for i, d in enumerate(datums)}
    loss_fn, loss_config = resolve_loss(cfg.loss.name, cfg.loss.resolved_options())
    dropped: list[DroppedGroups] = []
    scaled: list[CappedGroups] = []
    weights_seen: list[float] = []
    loss_fn = capped(loss_fn, cfg.rl.max_group_weight, scaled, weights_seen)
    loss_fn = bounded(loss_fn, cfg.rl.max_log_ratio, cfg.rl.max_abs_reward, dropped)
    if world > 1:
        loss_fn = refused_on_any_rank(loss_fn, rank, world)
    if cfg.rl.drop_uniform_groups:
        datums = [d for group in group_rows(datums) if has_signal([group]) for d in group]
    for batch in minibatches(datums, cfg.rl.updates_per_batch):
        groups = group_rows(batch)
        if not has_signal(groups):
            continue  # (every rank decides alike, so no rank waits in an all-reduce the others skip)
        if len(groups) < world:
            reason = TOO_FEW_GROUPS
            continue
        share = [d for g in groups[rank::world] for d in g]
        dropped.clear()
        scaled.clear()
        refused, out = None, None
        try:
            out = training.forward_backward(share, loss_fn, loss_config,
                                            temperature=cfg.rollout.temperature or 1.0).result()
        except LossInputError as exc:
            # the learner outlives a batch its loss cannot take: no step on it (the loss refuses before backward,
            # on every rank, so no gradient of it was accumulated)
            refused = str(exc)
        if dropped:
            count = sum(len(d.group_ids) for d in dropped)
            metrics["optim/dropped_groups"] = metrics.get("optim/dropped_groups", 0) + count
            log.warning("dropped %d of %d group(s) of a minibatch before its loss: %s", count,
                        len(groups[rank::world]), "; ".join(d.reason for d in dropped))
        if scaled and out is not None:
            count = sum(len(c.group_ids) for c in scaled)
            metrics["optim/capped_groups"] = metrics.get("optim/capped_groups", 0) + count
            log.warning("scaled down the gradient of %d of %d group(s) of a minibatch: effective importance weight "
                        "up to %.4g > rl.max_group_weight = %g", count, len(groups[rank::world]),
                        max(w for c in scaled for w in c.weights), cfg.rl.max_group_weight)
        if out is not None:
            if fresh_logprobs is not None and not metrics["optim/updates"]:
                fresh_logprobs.update((row_of[id(d)], lp) for d, lp in zip(share, out.logprobs))
            lr = learning_rate(training.step + 1, cfg.optim.lr, total_updates, cfg.optim.warmup_steps,
                               cfg.optim.schedule, cfg.optim.min_lr_ratio)
            optim = training.optim_step(AdamParams(
                learning_rate=lr, beta1=cfg.optim.beta1, beta2=cfg.optim.beta2,
                weight_decay=cfg.optim.weight_decay, grad_clip_norm=cfg.optim.grad_clip_norm)).result()
            if optim.skipped:
                refused = (f"its gradient norm is {optim.grad_norm} (not finite): the optimizer step was skipped and "
                           "the gradients zeroed")
        if refused is not None:
            log.warning("skipped a minibatch of %d rows without an update: %s", len(batch), refused)
            metrics["optim/bad_batches"] = metrics.get("optim/bad_batches", 0) + 1
            if skipped is not None:
                skipped.append(SkippedUpdate([row_of[id(d)] for d in batch], refused))
            continue
        if dropped and skipped is not None:
            ids = {i for d in dropped for i in d.group_ids}
            skipped.append(SkippedUpdate([row_of[id(d)] for d in share if d.group_id in ids],
                                         "; ".join(d.reason for d in dropped)))
        metrics.update(out.metrics)
        metrics.update({"optim/lr": lr, "optim/grad_norm": optim.grad_norm})
        metrics["optim/updates"] += 1
    if weights_seen and metrics["optim/updates"]:
        metrics["optim/group_weight_max"] = max(weights_seen)
    if not metrics["optim/updates"]:
        metrics["optim/skip_reason"] = BAD_BATCH if "optim/bad_batches" in metrics else reason
        if fresh_logprobs is not None or shard[1] > 1:  # (every rank forwards: a sharded forward is collective)
            _forward_for_logprobs(training, datums, cfg, shard, row_of, fresh_logprobs)
    return metrics


def _forward_for_logprobs(training: TrainingClient, datums: list[Datum], cfg: Config, shard: tuple[int, int],
                          row_of: dict[int, int], fresh_logprobs: dict[int, list[float]] | None) -> None:
    """A step that ran no update still measures the training–inference mismatch: one forward (no gradient) of
    this rank's share of the first minibatch. Under data parallelism every rank forwards its share (the ranks
    that keep no log-probs too: an FSDP forward gathers the weights from all of them)."""
    rank, world = shard
    batches = minibatches(datums, cfg.rl.updates_per_batch) if datums else []
    groups = group_rows(batches[0]) if batches else []
    if len(groups) < world:
        return
    share = [d for g in groups[rank::world] for d in g]
    try:
        out = training.forward(share, "cross_entropy", temperature=cfg.rollout.temperature or 1.0).result()
    except (LossInputError, HeteroRLError) as exc:
        log.warning("could not measure the mismatch of a step without an update: %s", exc)
        return
    if fresh_logprobs is not None:
        fresh_logprobs.update((row_of[id(d)], lp) for d, lp in zip(share, out.logprobs))
