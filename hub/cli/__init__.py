"""The ``gpulab`` command: ``up`` (the local deployment), ``quota``, ``usage`` and ``jobs``
(the gpulab service's API from a terminal), ``config-reference``, ``service`` (the hub as a
systemd service).

`main` and `build_parser` are `gpulab.hub.cli.main`'s (the console script is
``gpulab.hub.cli:main``); the modules, from the bottom: ``common`` (what the commands share),
``up``, ``quota``, ``jobs``, ``docs``, ``service``, then ``main``, the only one that imports the others."""

from gpulab.hub.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
