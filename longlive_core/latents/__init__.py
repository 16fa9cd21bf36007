"""The latent cache: Balanced-SP chunk-halo VAE encoding (``halo``)."""
