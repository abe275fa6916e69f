"""Episodes: an agent on a Terminal-Bench 2 / Harbor task, scored by a verifier it cannot reach.

:class:`~.episode.Episode` orders the steps; :mod:`.view` plans the agent's filesystem,
:mod:`.staging` places the task's files, :mod:`.nsexec` (with its trusted helper process)
enters the episode's namespaces, :mod:`.shell` drives the agent's persistent shell,
:mod:`.verifier` reads verdicts strictly, :mod:`.tamper` lists what the agent changed that
the verifier runs on, :mod:`.freezer` stops the agent during the verify window.
"""
