# gpulab settings for this data folder, read by `gpulab up` on every start.
#
# Any JupyterHub or gpulab setting may go here (see the configuration reference in the
# README). The addresses, ports and folders given to `gpulab up` on its command line win
# over this file. Examples:
#
# c.GPUInventory.simulated_gpus = 8
# c.LocalGPUSpawner.profile_list = [
#     {"display_name": "CPU only", "slug": "cpu"},
#     {"display_name": "1 GPU", "slug": "gpu-1", "default": True,
#      "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}}},
# ]
# c.JupyterHub.named_server_limit_per_user = 3
