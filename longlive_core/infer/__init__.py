"""Autoregressive generation chunk by chunk: the self-attention KV cache and the few-step rollout that
distillation (self-forcing) and the inference engine share."""
