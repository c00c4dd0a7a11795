"""``python -m gpulab.hub.service``: the gpulab service, as the hub starts it."""

from gpulab.hub.service.app import main

main()
