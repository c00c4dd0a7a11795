"""The one-machine substrate that notebook servers and training jobs both stand on (local
mode): system accounts and folders (`accounts`), cgroups and their device filter (`cgroups`,
`bpfdevices`, `delegation`), sandboxes (`sandbox`), safe file access in a person's folder
(`safefs`), the GPU inventory and usage (`inventory`, `gpuusage`). Imported by
`gpulab.spawner` and `gpulab.hub.jobs`, never the reverse."""
