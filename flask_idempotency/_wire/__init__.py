"""Hand-written protocol code, one module per library."""
