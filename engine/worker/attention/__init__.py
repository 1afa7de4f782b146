"""Attention backends over the shared paged KV layout (see base.py)."""
