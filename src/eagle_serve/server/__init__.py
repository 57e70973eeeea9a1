"""Running the server: `make serve`'s launcher, its supervisor and health checks, setup,
replicas behind a router."""
