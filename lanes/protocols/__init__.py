"""Wire shapes of the protocols lanes speaks (pure pydantic and functions, no HTTP)."""

# lanes' own header, on every protocol: a request's deadline, in milliseconds.
TIMEOUT_HEADER = "X-Timeout-Ms"
# A request's id: the caller's when it sends one, else the server's; always answered.
REQUEST_ID_HEADER = "X-Request-Id"
