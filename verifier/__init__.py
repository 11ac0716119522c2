"""Target-model engine, per-sequence KV caches and lossless rejection sampling."""
