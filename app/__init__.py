"""RadixServe app."""
