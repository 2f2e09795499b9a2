"""specjax.eval."""
