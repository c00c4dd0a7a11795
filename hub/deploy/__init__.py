"""Deployments: the configuration builders of the local hub (`local`, run by `localhub`) and of
the z2jh chart's hub (`kubernetes`), gpulab's login (`auth`), OpenID Connect (`oidc`), the idle
culler (`culler`), the local data folder (`datadir`) and the gpulab service's config file that
both hubs write (`serviceconfig`)."""
