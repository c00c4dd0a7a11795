"""The ``gpulab`` command: ``up`` (the local deployment), ``quota``, ``usage`` and ``jobs``
(the gpulab service's API from a terminal), ``config-reference``."""

from gpulab.hub.cli.up import build_parser, main  # noqa: F401
