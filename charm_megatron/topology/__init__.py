"""topology layer (see docs/design.md)."""
