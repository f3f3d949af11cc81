"""megatron layer (see docs/design.md)."""
