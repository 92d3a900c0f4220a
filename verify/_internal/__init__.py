"""Internal: not the public API (see verify.__all__)."""
