"""What one Dockerfile instruction asks the builder to do, as plain data. Pure.

The planner (:mod:`.plan`) turns each instruction of a stage, with Docker's expansion
already applied against the stage's environment (the base image's config ``Env``, then
``ARG`` and ``ENV`` in order), into one of these steps. The builder (:mod:`.builder`)
executes the ones that change the filesystem and chains every step's ``key_text`` into
the cache key of the layer it produces (config-only steps produce no layer but still
change the key of everything after them, as in Docker).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConfigStep", "RunStep", "CopyStep", "WorkdirStep", "Step"]


@dataclass(frozen=True)
class ConfigStep:
    """An instruction that changes only the image's config (ENV, ARG, LABEL, USER, EXPOSE,
    VOLUME, CMD, ENTRYPOINT, HEALTHCHECK, STOPSIGNAL, SHELL)."""

    line: int
    text: str  # the instruction as written, continuations joined (for progress and errors)
    key_text: str  # canonical, expanded form that enters the cache key


@dataclass(frozen=True)
class RunStep:
    line: int
    text: str
    key_text: str
    argv: tuple[str, ...]  # the shell form already wrapped in SHELL (["/bin/sh", "-c", ...])
    env: tuple[tuple[str, str], ...]  # the process's environment: config Env, then ARGs in scope ENV does not set
    workdir: str  # absolute
    user: str  # the USER in effect ("" = the image's default, root), expanded
    network: str | None = None  # RUN --network=default|none (None: the build's policy)


@dataclass(frozen=True)
class CopyStep:
    line: int
    text: str
    key_text: str
    add: bool  # ADD semantics: URLs download, local tar archives extract
    sources: tuple[str, ...]  # expanded; context-relative (or absolute in --from), or URLs for ADD
    dest: str  # absolute (relative ones resolved against WORKDIR), normalised
    dest_is_dir: bool  # a trailing "/" or several sources: sources go *into* dest
    from_stage: int | None = None  # COPY --from=<earlier stage name or index>
    from_image: str | None = None  # COPY --from=<image reference>
    chown: str | None = None  # expanded --chown value
    chmod: str | None = None  # expanded --chmod value (octal)
    user: str = ""  # the USER in effect (Docker copies as root regardless)
    checksum: str | None = None  # ADD --checksum=sha256:<hex> of the one URL source (the builder verifies it)


@dataclass(frozen=True)
class WorkdirStep:
    """WORKDIR: the folder is made when the layers lack it (as Docker does)."""

    line: int
    text: str
    key_text: str
    path: str  # absolute, normalised
    user: str


Step = ConfigStep | RunStep | CopyStep | WorkdirStep
