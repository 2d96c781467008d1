"""Delay sweeps: the runner (cells over losses x delays x seeds) and the report."""
