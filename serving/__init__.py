"""The online wing: the ASGI endpoint for interactive workloads. Never imports prefect or torch."""
