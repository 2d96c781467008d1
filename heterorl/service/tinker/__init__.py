"""Tinker's REST API on `heterorl serve` (docs/SERVICE.md, "From Tinker"): its official SDK and cookbook run
against this service unchanged."""
