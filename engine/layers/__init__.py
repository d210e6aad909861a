"""Model building blocks, one file per layer: linear (the protocol every precision implements),
rotary (RoPE), norm (RMSNorm), attention (paged attention over the KV storage)."""
