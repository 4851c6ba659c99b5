"""The HTTP face of a server process: the aiohttp application (signalling, the web client, health
and metrics), its middleware, the bearer token, and requests to sibling worker processes."""
