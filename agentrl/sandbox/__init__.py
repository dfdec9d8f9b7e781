"""Sandboxes: where an agent's tools run (Docker containers, or a local temp dir)."""
