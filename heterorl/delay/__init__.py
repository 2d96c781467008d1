"""The network-delay injector: delay models and links, clocks, and delayed delivery."""
