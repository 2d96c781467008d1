"""A test network on one machine: hosts in network namespaces joined by shaped links (docs/NETLAB.md)."""

from heterorl.netlab.lab import LEARNER_ADDRESS, LinkShape, NetLab, has_netem, missing

__all__ = ["LEARNER_ADDRESS", "LinkShape", "NetLab", "has_netem", "missing"]
