"""Helpers of `engine.scheduler` (pure Python, no torch): the waiting queues."""
