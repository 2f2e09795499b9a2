"""specjax.configs."""
