"""Wire shapes of the protocols lanes speaks (pure pydantic and functions, no HTTP)."""
