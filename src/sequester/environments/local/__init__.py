"""The local backend: an episode in namespaces of this host, on the task's image or the
host's system, scored by a verifier it cannot reach.

:class:`~.episode.Episode` orders the steps: :mod:`.system` starts the sandbox on the
chosen system (:mod:`.start` on the host's, :mod:`.image_start` on an image's), whose
filesystem :mod:`.view` and :mod:`.image_view` plan and :mod:`.staging` fills;
:mod:`.limits` applies the task's resources; :mod:`.shell` drives the agent's persistent
shell; :mod:`.evaluation` runs the pristine tests through the namespace helper
(:mod:`sequester.sandbox.nsexec`), in the agent's view or a separate one
(:mod:`.separate`), and :mod:`sequester.environments.verdict` reads the verdict;
:mod:`.layers` and :mod:`.tamper` list what the agent changed that a verifier on its
system would trust; :mod:`.state` keeps the writable layers on the host.
"""
