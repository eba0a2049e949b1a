"""Memory: the paged KV pool, its page allocator and the radix-tree prefix cache over it."""
