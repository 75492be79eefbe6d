"""Block layout and the refcounted block allocator (plain Python, no torch)."""
