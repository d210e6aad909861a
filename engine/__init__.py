"""MorphServe inference engine: a small vLLM-style engine whose layers change precision and whose
KV cache changes size between any two steps. Start at docs/ARCHITECTURE.md for the file map."""
