"""mmenc encoder server: models, worker, gateway, CLI."""
