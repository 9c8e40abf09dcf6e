"""Built-in plugins of this kind; each module registers one plugin type."""
