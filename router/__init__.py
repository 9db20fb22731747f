"""The top floor: the router (plan, serve, compile, deploy) and the `lanes` CLI."""
