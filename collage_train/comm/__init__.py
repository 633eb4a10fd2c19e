"""Communication strategies: compressed exchange of pseudo-gradients between replicas."""
