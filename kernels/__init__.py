"""specjax.kernels."""
