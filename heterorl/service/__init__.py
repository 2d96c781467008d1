"""Training sessions as a service: `heterorl serve` (HTTP), its client (`heterorl.session`) and the
OpenAI-compatible endpoint over sampling clients (docs/SERVICE.md)."""
