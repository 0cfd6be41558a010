"""RadixServe deployments."""
