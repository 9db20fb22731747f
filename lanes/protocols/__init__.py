"""Wire shapes of the protocols lanes speaks (pure pydantic and functions, no HTTP)."""

# lanes' own header, on every protocol: a request's deadline, in milliseconds.
TIMEOUT_HEADER = "X-Timeout-Ms"
