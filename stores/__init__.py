"""specjax.stores."""
