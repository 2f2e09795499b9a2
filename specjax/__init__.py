"""specjax: prefix-KV caching on SSD with importance-informed selection and speculative prefetch."""
