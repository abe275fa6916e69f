"""The namespace helper: a trusted process that enters an episode's namespaces for the host.

:mod:`.client` is the host side; :mod:`.server` is the helper process (with :mod:`.ns`,
:mod:`.files` and :mod:`.root`, which it loads before any namespace change). Nothing is
imported here: the helper imports only what it runs.
"""
