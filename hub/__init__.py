"""Hub side of gpulab: the configuration builder, login, the data folder and the CLI."""
