"""plan layer (see docs/design.md)."""
