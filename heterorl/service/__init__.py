"""Training sessions as a service: `heterorl serve` (HTTP), its client (`heterorl.service.client`) and the
OpenAI-compatible endpoint over sampling clients (docs/SERVICE.md)."""
