"""What every multi-rank role shares (training, distillation, inference, the latent cache): the
parallel config and its dimensions, the one launcher, the Ulysses exchange and its collectives, and
the one way a DiT is made parallel (``parallelize_dit``)."""
