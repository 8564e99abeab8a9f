"""PENCIL (Yang et al., ICML 2025): reasoning with reduction of the context."""
