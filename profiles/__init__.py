"""Per-hardware profiles (data files)."""
