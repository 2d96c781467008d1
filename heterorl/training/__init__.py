"""Training on this process: session primitives (TrainingClient, SamplingClient, futures), one optimisation
step, evaluation, the learning-rate schedule and the text codec."""
