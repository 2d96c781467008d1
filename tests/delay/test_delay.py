"""Delay injector: distributions against their definitions, links, clocks and delayed delivery."""

import math
import time
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
import pytest
from omegaconf import OmegaConf

from heterorl.config import LinkDelayConfig, load_trace
from heterorl.delay.clock import Clock, RealClock, ScaledClock
from heterorl.delay.links import DelayLink, DelayModel, LogNormalLatency, WeibullLatency, link_seed
from heterorl.delay.queue import DelayQueue
from heterorl.errors import ClockError, ConfigError, DelayConfigError

PAPER = dict(L_s=60.0, U_s=1920.0, d0_s=400.0, c=0.995)
N = 200_000


def model(seed=0, **fields) -> DelayModel:
    return DelayModel(LinkDelayConfig(**fields), np.random.default_rng(seed))


def assert_rate(hits: int, n: int, p: float) -> None:
    """The empirical rate hits/n is within 5 binomial standard errors of p."""
    se = math.sqrt(p * (1 - p) / n)
    assert abs(hits / n - p) <= 5 * se + 1e-12, (hits / n, p, se)


def assert_mean(x: np.ndarray, mean: float) -> None:
    assert abs(x.mean() - mean) <= 5 * x.std() / math.sqrt(len(x)) + 1e-12, (x.mean(), mean)


# ---- the paper's fits ------------------------------------------------------------------------------------------

def test_lognormal_fit_matches_hand_computed_parameters():
    fit = LogNormalLatency.fit(60, 1920, 0.995)
    z = 2.8070337683438  # Φ⁻¹(0.9975)
    assert fit.mu == pytest.approx(math.log(math.sqrt(60 * 1920)), rel=1e-12)
    assert fit.sigma == pytest.approx(math.log(32) / (2 * z), rel=1e-9)
    assert fit.cdf(60) == pytest.approx(0.0025, rel=1e-9) and fit.cdf(1920) == pytest.approx(0.9975, rel=1e-9)
    assert fit.quantile(0.0025) == pytest.approx(60, rel=1e-9) and fit.quantile(0.9975) == pytest.approx(1920)


def test_weibull_fit_puts_equal_tails_at_L_and_U():
    fit = WeibullLatency.fit(60, 1920, 0.995)
    a, b = -math.log(1 - 0.0025), -math.log(0.0025)
    assert fit.k == pytest.approx(math.log(b / a) / math.log(32), rel=1e-12)
    assert fit.k == pytest.approx(2.24499, abs=1e-5) and fit.scale_s == pytest.approx(864.888, abs=1e-3)
    assert fit.cdf(60) == pytest.approx(0.0025, rel=1e-9) and fit.cdf(1920) == pytest.approx(0.9975, rel=1e-9)
    assert fit.quantile(0.0025) == pytest.approx(60, rel=1e-9) and fit.quantile(0.9975) == pytest.approx(1920)


@pytest.mark.parametrize("kind", ["lognormal", "weibull"])
def test_sampled_latency_holds_c_inside_L_U_with_equal_tails(kind):
    m = model(kind=kind, seed=0, **PAPER)
    t = m.latency.sample(np.random.default_rng(1), N)
    assert abs(np.mean((t >= 60) & (t <= 1920)) - 0.995) <= 0.001
    assert_rate(int(np.sum(t < 60)), N, 0.0025)
    assert_rate(int(np.sum(t > 1920)), N, 0.0025)
    assert np.median(t) == pytest.approx(m.latency.quantile(0.5), rel=0.01)


@pytest.mark.parametrize("kind", ["lognormal", "weibull"])
def test_paper_delay_is_clamped_with_the_predicted_mass_at_the_bounds(kind):
    m = model(kind=kind, **PAPER)
    d = m.sample(N)
    assert d.min() == 60.0 and d.max() <= 1920.0
    assert_rate(int(np.sum(d == 60.0)), N, m.latency.cdf(60 + 400))
    assert_rate(int(np.sum(d == 1920.0)), N, 1 - m.latency.cdf(1920 + 400))
    for p in (0.9, 0.99):
        assert np.quantile(d, p) == pytest.approx(m.quantile(p), rel=0.02)
    assert_mean(d, m.mean_s())


def test_lognormal_delay_mean_matches_its_closed_form():
    # E[clamp(T − d0, L, U)] = L·F(a) + U·(1 − F(b)) + E[T; a<T<b] − d0·(F(b) − F(a)), a = L+d0, b = U+d0,
    # E[T; a<T<b] = exp(μ + σ²/2)·(Φ((ln b − μ − σ²)/σ) − Φ((ln a − μ − σ²)/σ))
    m = model(kind="lognormal", **PAPER)
    mu, s = m.latency.mu, m.latency.sigma
    a, b, phi = 460.0, 2320.0, NormalDist().cdf
    fa, fb = m.latency.cdf(a), m.latency.cdf(b)
    partial = math.exp(mu + s * s / 2) * (phi((math.log(b) - mu - s * s) / s) - phi((math.log(a) - mu - s * s) / s))
    assert m.mean_s() == pytest.approx(60 * fa + 1920 * (1 - fb) + partial - 400 * (fb - fa), rel=1e-6)


def test_weibull_median_delay_is_the_shifted_latency_median():
    m = model(kind="weibull", **PAPER)
    median_t = m.latency.scale_s * math.log(2) ** (1 / m.latency.k)
    assert m.quantile(0.5) == pytest.approx(median_t - 400, rel=1e-12)
    assert np.median(m.sample(N)) == pytest.approx(median_t - 400, rel=0.01)


# ---- the simple kinds ------------------------------------------------------------------------------------------

def test_uniform_exponential_constant_and_none_follow_their_definitions():
    u = model(kind="uniform", low_s=10, high_s=30).sample(N)
    assert u.min() >= 10 and u.max() < 30
    assert_mean(u, 20.0)
    assert np.quantile(u, 0.25) == pytest.approx(15, abs=0.1)

    m = model(kind="exponential", mean_s=50)
    e = m.sample(N)
    assert e.min() >= 0
    assert_mean(e, 50.0)
    assert m.quantile(0.5) == pytest.approx(50 * math.log(2)) and np.median(e) == pytest.approx(50 * math.log(2),
                                                                                                  rel=0.01)
    assert_rate(int(np.sum(e > 50)), N, math.exp(-1))

    assert set(model(kind="constant", constant_s=7.5).sample(100)) == {7.5}
    assert set(model(kind="none").sample(100)) == {0.0}


def test_trace_replays_in_order_and_cycles(tmp_path):
    path = tmp_path / "lat.txt"
    path.write_text("# recorded latencies, seconds\n3.5\n\n1  # a fast one\n 20\n")
    assert load_trace(path).tolist() == [3.5, 1.0, 20.0]
    link = DelayLink(LinkDelayConfig(kind="trace", trace_path=str(path), reorder=True))
    assert [link.schedule(100.0 * i) - 100.0 * i for i in range(7)] == [3.5, 1.0, 20.0, 3.5, 1.0, 20.0, 3.5]


# ---- links: seeds, order, loss, bandwidth ----------------------------------------------------------------------

def deliveries(config, name="worker-0/trajectories", n=2000, gap_s=1.0):
    link = DelayLink(config, name)
    return [link.schedule(i * gap_s) for i in range(n)]


def test_link_seed_is_stable_and_depends_on_seed_and_name():
    assert link_seed(7, "worker-0/trajectories") == 0xCBD19C2680A6C6D8  # pinned: a change breaks reproducibility
    seeds = {link_seed(7, "worker-0/trajectories"), link_seed(7, "worker-0/weights"),
             link_seed(8, "worker-0/trajectories")}
    assert len(seeds) == 3


def test_same_seed_same_sequence_different_seed_or_link_different():
    cfg = LinkDelayConfig(kind="weibull", seed=3, loss_prob=0.1)
    assert deliveries(cfg) == deliveries(LinkDelayConfig(kind="weibull", seed=3, loss_prob=0.1))
    assert deliveries(cfg) != deliveries(LinkDelayConfig(kind="weibull", seed=4, loss_prob=0.1))
    assert deliveries(cfg) != deliveries(cfg, name="worker-1/trajectories")


def test_order_preserving_link_delivers_at_max_of_sampled_and_previous():
    cfg = LinkDelayConfig(kind="lognormal", seed=1)
    got = deliveries(cfg, gap_s=5.0)
    delays = DelayLink(cfg, "worker-0/trajectories").model.sample(len(got))  # the same stream
    expected, last = [], -math.inf
    for i, d in enumerate(delays):
        last = max(5.0 * i + d, last)
        expected.append(last)
    assert got == expected
    assert any(5.0 * i + d < e for i, (d, e) in enumerate(zip(delays, expected)))  # the max did bite


def test_reorder_mode_delivers_at_sampled_times_and_reorders():
    cfg = LinkDelayConfig(kind="lognormal", seed=1, reorder=True)
    got = deliveries(cfg, gap_s=5.0)
    delays = DelayLink(cfg, "worker-0/trajectories").model.sample(len(got))
    assert got == [5.0 * i + d for i, d in enumerate(delays)]
    assert sum(b < a for a, b in zip(got, got[1:])) > 100


def test_loss_rate_and_losses_leave_the_delay_stream_unchanged():
    lossy = deliveries(LinkDelayConfig(kind="exponential", mean_s=30, loss_prob=0.3, reorder=True), n=20_000)
    clean = deliveries(LinkDelayConfig(kind="exponential", mean_s=30, reorder=True), n=20_000)
    assert_rate(sum(d is None for d in lossy), len(lossy), 0.3)
    assert all(d == c for d, c in zip(lossy, clean) if d is not None)
    assert set(deliveries(LinkDelayConfig(loss_prob=1.0), n=50)) == {None}


def test_bandwidth_adds_size_over_bandwidth_and_queues_fifo():
    link = DelayLink(LinkDelayConfig(kind="constant", constant_s=10, bandwidth_bytes_per_s=1000))
    assert [link.schedule(0.0, 2000) for _ in range(3)] == [12.0, 14.0, 16.0]  # 2 s each on the wire, queued
    assert link.schedule(5.0, 500) == 16.5  # link busy until 6 s, then 0.5 s on the wire, then 10 s of delay
    assert link.schedule(100.0, 1000) == 111.0  # an idle link: no queueing
    assert link.schedule(100.0, 0) == 111.0


def test_schedule_rejects_sends_out_of_order_and_bad_sizes():
    link = DelayLink(LinkDelayConfig())
    link.schedule(10.0)
    with pytest.raises(ValueError, match="before the previous send"):
        link.schedule(9.0)
    with pytest.raises(ValueError, match="size_bytes"):
        link.schedule(11.0, -1)


# ---- clocks ----------------------------------------------------------------------------------------------------

def test_scaled_clock_runs_factor_times_faster():
    clock = ScaledClock(200)
    assert isinstance(clock, Clock) and isinstance(RealClock(), Clock) and RealClock().factor == 1.0
    real_a, sim_start, real_b = time.monotonic(), clock.now(), time.monotonic()
    time.sleep(0.1)  # 20 simulated seconds
    real_c, sim_end, real_d = time.monotonic(), clock.now(), time.monotonic()
    # the simulated interval, scaled back, lies between the real intervals that bracket its two readings
    assert real_c - real_b <= (sim_end - sim_start) / 200 <= real_d - real_a
    assert 0.1 <= real_c - real_b < 5.0  # never short; the upper bound only needs the machine not to stall 5 s
    with pytest.raises(ClockError, match="factor"):
        ScaledClock(0)


# ---- delayed delivery ------------------------------------------------------------------------------------------

def test_delay_queue_on_virtual_time_delivers_exactly_on_schedule():
    now = 0.0
    link, queue = DelayLink(LinkDelayConfig(kind="weibull", reorder=True, seed=2)), DelayQueue()
    send_times = [7.0 * i for i in range(50)]
    scheduled, received = {}, []
    while len(received) < len(send_times):  # a discrete-event loop: sends and deliveries, earliest first
        while len(scheduled) < len(send_times) and send_times[len(scheduled)] <= now:
            i = len(scheduled)
            scheduled[i] = link.schedule(now)
            queue.put(scheduled[i], i)
        received += [(now, m) for _, _, m in queue.pop_due(now)]
        events = [t for t in (queue.next_due_time(), *send_times[len(scheduled):len(scheduled) + 1]) if t is not None]
        if events:
            now = min(events)
    assert all(t == scheduled[m] for t, m in received)  # popped at exactly its delivery time
    assert [m for _, m in received] == sorted(scheduled, key=scheduled.get)
    assert [m for _, m in received] != sorted(scheduled)  # the reordering link did reorder


def test_delay_queue_keeps_put_order_among_ties_and_restores_entries_in_place():
    """Without a delay every message of a burst is due at the same time: they must leave in put order, and
    entries a sender could not send go back ahead of anything put since, even at the same due time."""
    queue = DelayQueue()
    for name in "abcd":
        queue.put(1.0, name)
    held = queue.pop_due(1.0)
    assert [m for _, _, m in held] == list("abcd") and len(queue) == 0
    queue.put(1.0, "e")  # put while a-d were out
    queue.restore(held[2:])  # c and d could not be sent
    assert queue.count_due(1.0) == 3 and [m for _, _, m in queue.pop_due(1.0)] == ["c", "d", "e"]


def test_delay_queue_counts_and_pops_only_what_is_due():
    queue = DelayQueue()
    for due_s, name in ((5.0, "late"), (1.0, "early"), (3.0, "middle")):
        queue.put(due_s, name)
    assert [queue.count_due(t) for t in (0.5, 1.0, 4.0, 5.0)] == [0, 1, 2, 3]
    assert queue.pop_due(0.5) == [] and queue.next_due_time() == 1.0
    assert [m for _, _, m in queue.pop_due(4.0)] == ["early", "middle"]
    assert list(queue) == ["late"] and queue.next_due_time() == 5.0
    queue.clear()
    assert len(queue) == 0 and queue.next_due_time() is None and queue.pop_due(math.inf) == []


# ---- configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, key, phrase", [
    (dict(kind="gamma"), "delay.kind", "one of none, constant"),
    (dict(kind="constant", constant_s=-1), "delay.constant_s", "cannot be negative"),
    (dict(kind="uniform", low_s=5, high_s=1), "delay.high_s", "swap them"),
    (dict(kind="exponential"), "delay.mean_s", "must be > 0"),
    (dict(kind="lognormal", L_s=1920, U_s=60), "delay.U_s", "must be > `delay.L_s`"),
    (dict(kind="weibull", L_s=0), "delay.L_s", "must be > 0"),
    (dict(kind="weibull", c=1.0), "delay.c", "in (0, 1)"),
    (dict(kind="lognormal", d0_s=-5), "delay.d0_s", ">= 0"),
    (dict(kind="lognormal", U_s=float("nan")), "delay.U_s", "finite"),
    (dict(kind="trace"), "delay.trace_path", "is required"),
    (dict(loss_prob=1.5), "delay.loss_prob", "[0, 1]"),
    (dict(bandwidth_bytes_per_s=0), "delay.bandwidth_bytes_per_s", "null for unlimited"),
    (dict(seed=1.5), "delay.seed", "integer"),
])
def test_invalid_config_names_the_field_and_the_fix(fields, key, phrase):
    with pytest.raises(DelayConfigError, match=f"`{key}`") as caught:
        LinkDelayConfig(**fields).validate()
    assert phrase in str(caught.value) and isinstance(caught.value, ConfigError)


@pytest.mark.parametrize("text, phrase", [
    ("1.0\n2.0\nfast\n", "line 3: 'fast' is not a number"),
    ("# header\n1.0\n-2.0\n", "line 3: '-2.0' is not a finite latency >= 0"),
    ("1.0\nnan\n", "line 2"),
    ("# nothing\n\n", "holds no latencies"),
])
def test_bad_trace_file_names_the_line(tmp_path, text, phrase):
    path = tmp_path / "lat.txt"
    path.write_text(text)
    with pytest.raises(DelayConfigError, match="lat.txt") as caught:
        DelayLink(LinkDelayConfig(kind="trace", trace_path=str(path)))
    assert phrase in str(caught.value)


def test_missing_trace_file_is_named(tmp_path):
    with pytest.raises(DelayConfigError, match=r"nope\.txt .*does not exist"):
        LinkDelayConfig(kind="trace", trace_path=str(tmp_path / "nope.txt")).validate(key="rollout.delay")


def test_config_nests_in_an_omegaconf_structured_config():
    @dataclass
    class Run:
        delay: LinkDelayConfig = field(default_factory=LinkDelayConfig)

    run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Run),
                                              OmegaConf.from_dotlist(["delay.kind=weibull", "delay.U_s=3600",
                                                                      "delay.bandwidth_bytes_per_s=1e6"])))
    assert run.delay == LinkDelayConfig(kind="weibull", U_s=3600.0, bandwidth_bytes_per_s=1e6)
    run.delay.validate()
