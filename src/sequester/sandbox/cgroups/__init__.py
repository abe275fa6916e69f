"""cgroups: one way to find a hierarchy, our own cgroups in it, and the limits and freezer
cgroups every backend and the image builder use."""
