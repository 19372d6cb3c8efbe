"""Runnable examples (tensor parallelism over kv heads)."""
