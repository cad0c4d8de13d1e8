"""Capturing hidden states inside vLLM's workers: hooks, per-request assembly, device copies, statistics."""
