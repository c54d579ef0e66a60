"""The KV cache and what lives beside it: cache layers per layer kind (attention KV, linear-attention state),
the batch of rows' caches (`batch`), and the prefix cache that reuses a prompt's cached prefix."""
