"""A model namespace's identity and state: which weights its KV came from, what it
holds in words, who serves it, and its figures read without opening a store."""
