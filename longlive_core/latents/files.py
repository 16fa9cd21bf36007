"""Names of the latent cache's files that its readers share with the encoder (which needs PyAV; they do not)."""
EMPTY_PROMPT = "empty_prompt.safetensors"  # beside the index: the empty caption's embedding, (T, D), for guidance
