"""Hand-written protocol code, one module per library (each names the private APIs it touches)."""
