"""The network of ``sequester build``: which targets a Dockerfile's ``RUN`` lines may reach
(:mod:`.network`), and the proxy that is their only way out (:mod:`.proxy`)."""
