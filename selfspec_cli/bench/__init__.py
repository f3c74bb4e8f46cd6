"""Side-by-side benchmarking of selfspec methods and outside peers."""
