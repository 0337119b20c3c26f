"""TRANSITIONAL shim."""
