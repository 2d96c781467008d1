"""Training loops over the session primitives, one screen each: SFT and the synchronous RL loop."""
