"""RadixServe engine."""
