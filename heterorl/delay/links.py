"""Network-delay model: how long each message on a link takes, seeded and reproducible.

A *link* is one direction to or from one worker ("worker-3/trajectories" up, "worker-3/weights" down). For each
message sent at ``send_s`` with ``size_bytes``, `DelayLink.schedule` returns its delivery time (or None if lost):

    transmitted_s = max(send_s, link_free_s) + size_bytes / bandwidth    (FIFO serialisation; 0 if unlimited)
    delivery_s    = transmitted_s + delay_s                               delay_s ~ the configured distribution
    delivery_s    = max(delivery_s, previous delivery_s)                  unless reorder (order-preserving link)

The GEPO paper's model (arXiv 2508.17850; kinds ``lognormal`` and ``weibull``): latency T has the central
interval [L, U] with probability c, (1−c)/2 in each tail, and

    delay_s = clamp(T − d0, L, U)

— so every delay lies in [L, U] and the bounds carry point masses F_T(L + d0) and 1 − F_T(U + d0).
The fitting rules are in `LogNormalLatency.fit` and `WeibullLatency.fit`; docs/DELAY.md has the whole picture.
Pure: no sockets, no clocks (times are passed in); `heterorl.delay.queue` holds messages until they are due.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from heterorl.config import LinkDelayConfig, load_trace


def _tails(c: float) -> tuple[float, float]:
    """(p_lo, p_hi) = ((1−c)/2, (1+c)/2): the CDF values at L and U for a central interval of mass c."""
    return (1 - c) / 2, (1 + c) / 2


@dataclass(frozen=True)
class LogNormalLatency:
    """T = exp(μ + σ·Z), Z ~ N(0, 1);  F(t) = Φ((ln t − μ)/σ)."""

    mu: float
    sigma: float

    @classmethod
    def fit(cls, L_s: float, U_s: float, c: float) -> LogNormalLatency:
        """F(L) = (1−c)/2 and F(U) = (1+c)/2. With z = Φ⁻¹((1+c)/2), ln L = μ − σz and ln U = μ + σz, so

            μ = (ln L + ln U)/2        σ = (ln U − ln L)/(2z)
        """
        z = NormalDist().inv_cdf(_tails(c)[1])
        return cls(mu=(math.log(L_s) + math.log(U_s)) / 2, sigma=(math.log(U_s) - math.log(L_s)) / (2 * z))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.exp(self.mu + self.sigma * rng.standard_normal(n))

    def cdf(self, t_s: float) -> float:
        return NormalDist(self.mu, self.sigma).cdf(math.log(t_s)) if t_s > 0 else 0.0

    def quantile(self, p: float) -> float:
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(p))


@dataclass(frozen=True)
class WeibullLatency:
    """F(t) = 1 − exp(−(t/λ)^k);  T = λ·E^(1/k) with E ~ Exp(1)."""

    k: float
    scale_s: float  # λ

    @classmethod
    def fit(cls, L_s: float, U_s: float, c: float) -> WeibullLatency:
        """F(L) = p_lo = (1−c)/2 and F(U) = p_hi = (1+c)/2. With a = −ln(1 − p_lo), b = −ln(1 − p_hi):
        (L/λ)^k = a and (U/λ)^k = b; dividing, (U/L)^k = b/a, so

            k = ln(b/a) / ln(U/L)      λ = U · b^(−1/k)
        """
        p_lo, p_hi = _tails(c)
        a, b = -math.log1p(-p_lo), -math.log1p(-p_hi)
        k = math.log(b / a) / math.log(U_s / L_s)
        return cls(k=k, scale_s=U_s * b ** (-1 / k))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.scale_s * rng.standard_exponential(n) ** (1 / self.k)

    def cdf(self, t_s: float) -> float:
        return -math.expm1(-((t_s / self.scale_s) ** self.k)) if t_s > 0 else 0.0

    def quantile(self, p: float) -> float:
        return self.scale_s * (-math.log1p(-p)) ** (1 / self.k)


def _simpson(f, a: float, b: float, intervals: int = 4000) -> float:
    h = (b - a) / intervals
    inner = sum((4 if i % 2 else 2) * f(a + i * h) for i in range(1, intervals))
    return h / 3 * (f(a) + inner + f(b))


class DelayModel:
    """Draws one link's delays in seconds from a LinkDelayConfig; ``rng`` is the link's own generator.

    Stateful only for ``trace`` (the replay position). Formulas, by kind (V ~ U[0, 1), E ~ Exp(1)):
    none 0 · constant constant_s · uniform low_s + (high_s − low_s)·V · exponential mean_s·E
    · lognormal / weibull clamp(T − d0_s, L_s, U_s) · trace values[i mod n] for the i-th message.
    """

    def __init__(self, config: LinkDelayConfig, rng: np.random.Generator, key: str = "delay"):
        config.validate(key)
        self.config = config
        self._rng = rng
        self.latency: LogNormalLatency | WeibullLatency | None = None
        if config.kind == "lognormal":
            self.latency = LogNormalLatency.fit(config.L_s, config.U_s, config.c)
        elif config.kind == "weibull":
            self.latency = WeibullLatency.fit(config.L_s, config.U_s, config.c)
        self._trace = load_trace(config.trace_path, key) if config.kind == "trace" else None
        self._trace_pos = 0

    def sample(self, n: int) -> np.ndarray:
        """The next ``n`` delays (seconds), in order."""
        cfg, rng = self.config, self._rng
        if cfg.kind == "none":
            return np.zeros(n)
        if cfg.kind == "constant":
            return np.full(n, float(cfg.constant_s))
        if cfg.kind == "uniform":
            return cfg.low_s + (cfg.high_s - cfg.low_s) * rng.random(n)
        if cfg.kind == "exponential":
            return cfg.mean_s * rng.standard_exponential(n)
        if self.latency is not None:
            return np.clip(self.latency.sample(rng, n) - cfg.d0_s, cfg.L_s, cfg.U_s)
        positions = (self._trace_pos + np.arange(n)) % len(self._trace)
        self._trace_pos = (self._trace_pos + n) % len(self._trace)
        return self._trace[positions]

    def quantile(self, p: float) -> float:
        """The delay's p-quantile. For the paper's kinds: clamp(F_T⁻¹(p) − d0, L, U) (clamping is monotone)."""
        if not 0 < p < 1:
            raise ValueError(f"quantile p = {p!r}: must be in (0, 1)")
        cfg = self.config
        if cfg.kind == "none":
            return 0.0
        if cfg.kind == "constant":
            return float(cfg.constant_s)
        if cfg.kind == "uniform":
            return cfg.low_s + (cfg.high_s - cfg.low_s) * p
        if cfg.kind == "exponential":
            return -cfg.mean_s * math.log1p(-p)
        if self.latency is not None:
            return min(max(self.latency.quantile(p) - cfg.d0_s, cfg.L_s), cfg.U_s)
        return float(np.quantile(self._trace, p, method="inverted_cdf"))

    def mean_s(self) -> float:
        """The delay's mean. For the paper's kinds, E[clamp(X, L, U)] = L + ∫_L^U P(X > x) dx with X = T − d0,
        i.e. L + ∫_{L+d0}^{U+d0} (1 − F_T(t)) dt (Simpson's rule)."""
        cfg = self.config
        if self.latency is not None:
            survival = _simpson(lambda t: 1 - self.latency.cdf(t), cfg.L_s + cfg.d0_s, cfg.U_s + cfg.d0_s)
            return cfg.L_s + survival
        if cfg.kind == "trace":
            return float(self._trace.mean())
        return {"none": 0.0, "constant": float(cfg.constant_s), "uniform": (cfg.low_s + cfg.high_s) / 2,
                "exponential": float(cfg.mean_s)}[cfg.kind]

    def summary(self) -> dict:
        """What a user should see before a sweep: fitted parameters, mean and quantiles, mass at the clamp bounds."""
        cfg = self.config
        out: dict = {"kind": cfg.kind, "mean_s": self.mean_s()}
        out.update({f"p{round(p * 100):02d}_s": self.quantile(p) for p in (0.05, 0.5, 0.95, 0.99)})
        if self.latency is not None:
            out["latency"] = {"kind": cfg.kind, **vars(self.latency)}
            out["mass_at_L"] = self.latency.cdf(cfg.L_s + cfg.d0_s)
            out["mass_at_U"] = 1 - self.latency.cdf(cfg.U_s + cfg.d0_s)
        return out


def link_seed(base_seed: int, link_name: str) -> int:
    """A link's seed: the first 8 bytes of sha256("heterorl-delay/{base_seed}/{link_name}"), as an unsigned int.

    Stable across processes, machines and Python versions (``hash()`` is salted per process).
    """
    digest = hashlib.sha256(f"heterorl-delay/{base_seed}/{link_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class DelayLink:
    """The delay of one direction of one link; not thread-safe (its owner's lock guards it, with its `DelayQueue`).

    Delays and losses come from two independent streams spawned from ``link_seed(config.seed, name)``, so the
    i-th message's delay is the same whatever ``loss_prob`` is, and the same name and seed give the same run.
    A lost message still occupies the bandwidth (it was transmitted, then lost).
    """

    def __init__(self, config: LinkDelayConfig, name: str = "link", key: str = "delay"):
        self.config = config
        self.name = name
        self.seed = link_seed(config.seed, name)
        delay_stream, loss_stream = np.random.SeedSequence(self.seed).spawn(2)
        self.model = DelayModel(config, np.random.default_rng(delay_stream), key)
        self._loss_rng = np.random.default_rng(loss_stream)
        self._last_send_s = -math.inf
        self._link_free_s = -math.inf
        self._last_delivery_s = -math.inf
        self.sent = 0
        self.dropped = 0

    @property
    def free_at(self) -> float | None:
        """When the link has finished transmitting what it was given (None: no bandwidth limit)."""
        return None if self.config.bandwidth_bytes_per_s is None else self._link_free_s

    def schedule(self, send_time_s: float, size_bytes: int = 0) -> float | None:
        """Delivery time of a message sent at ``send_time_s`` (calls in send order), or None if it is lost."""
        if not send_time_s >= self._last_send_s:
            raise ValueError(f"link {self.name!r}: send_time_s = {send_time_s!r} is before the previous send "
                             f"({self._last_send_s!r}); schedule messages in the order they are sent")
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"link {self.name!r}: size_bytes = {size_bytes!r} must be an integer >= 0")
        self._last_send_s = send_time_s
        delay_s = float(self.model.sample(1)[0])
        lost = self._loss_rng.random() < self.config.loss_prob
        transmitted_s = send_time_s
        if self.config.bandwidth_bytes_per_s is not None:
            transmitted_s = max(send_time_s, self._link_free_s) + size_bytes / self.config.bandwidth_bytes_per_s
            self._link_free_s = transmitted_s
        self.sent += 1
        if lost:
            self.dropped += 1
            return None
        delivery_s = transmitted_s + delay_s
        if not self.config.reorder:
            delivery_s = max(delivery_s, self._last_delivery_s)
        self._last_delivery_s = max(self._last_delivery_s, delivery_s)
        return delivery_s


__all__ = ["LinkDelayConfig", "DelayLink", "DelayModel", "LogNormalLatency", "WeibullLatency", "link_seed",
           "load_trace"]
