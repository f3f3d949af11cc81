"""kernels layer (see docs/design.md)."""
