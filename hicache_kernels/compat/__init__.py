"""Compatibility layers with the APIs of other KV-transfer packages."""
