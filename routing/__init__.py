"""RadixServe routing."""
