"""Offline evaluation: synthetic long-context tasks generated in code."""
