"""Ground floor."""
