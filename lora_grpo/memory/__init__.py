"""The memory plan: a measured pass at start (probe), the same figures from a model's shapes (estimate), and
the sizes a run takes from them."""
