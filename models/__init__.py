"""Model definitions (installed as ``titan_mok.models``)."""
