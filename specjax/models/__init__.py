"""specjax.models."""
