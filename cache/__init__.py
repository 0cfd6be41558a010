"""Cache core: block hashing, radix prefix cache, block allocator, paged KV pool.

Pure data structures; the only heavy import is torch, and only in ``kv_pool``.
"""
