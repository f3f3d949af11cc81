"""ops layer (see docs/design.md)."""
