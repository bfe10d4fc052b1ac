"""Shared test helpers (tiny tokenizers and models built offline)."""
