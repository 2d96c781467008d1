"""Benchmarks: each prints our numbers against a named baseline measured side by side in the same run."""
