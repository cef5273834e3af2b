"""TileLang kernel definitions (build time only)."""
