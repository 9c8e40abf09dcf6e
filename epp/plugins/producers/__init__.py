"""Built-in data producers; each module registers one plugin type (``_``-prefixed modules are helpers)."""
