"""From a parsed Dockerfile to what each stage's instructions do, with Docker's semantics. Pure.

Two passes, both without I/O:

* :func:`stage_graph` and :func:`needed_stages` (from :mod:`.graph`, re-exported here):
  which stages a target needs and what each starts from (an image, ``scratch``, or an
  earlier stage), so the builder pulls and builds only those, in order; like BuildKit, a
  stage nothing depends on is skipped.
* :class:`StagePlanner`: one stage's instructions, given the config of the image it starts
  from, turned into :mod:`.steps` with every ``$VAR`` Docker would expand expanded, and
  the image config the stage ends with.

Every step's ``key_text`` is canonical JSON of what decides its effect (after expansion),
never of how it was written, so reformatting a Dockerfile keeps the cache and changing
what a step sees (an ENV value a RUN inherits) does not.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator, Mapping
from typing import Any

from sequester.errors import BuildError
from sequester.imagebuild.config_args import check_stop_signal, exposed_ports, healthcheck_test, volumes
from sequester.imagebuild.expand import Scope, fail, global_scope, name_values
from sequester.imagebuild.graph import StageBase, needed_stages, resolve_from, stage_graph, stage_names, target_stage
from sequester.imagebuild.steps import ConfigStep, CopyStep, RunStep, Step, WorkdirStep
from sequester.images.manifest import ImageConfig, Platform, host_platform
from sequester.tasks.dockerfile import absolute_path
from sequester.tasks.dockerfile_parse import Dockerfile, Instruction, exec_form
from sequester.tasks.dockerfile_syntax import WordError, expand_words

__all__ = [
    "StageBase",
    "stage_graph",
    "stage_names",
    "target_stage",
    "needed_stages",
    "StagePlanner",
    "DEFAULT_SHELL",
    "DEFAULT_PATH",
]

DEFAULT_SHELL = ("/bin/sh", "-c")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Docker's, for Linux
_CHMOD = re.compile(r"^[0-7]{1,4}$")
_CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _key(op: str, **fields: Any) -> str:
    """Canonical JSON: the same effect gives the same text, whatever the spelling."""
    return json.dumps({"op": op, **fields}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class StagePlanner:
    """One stage's steps and final config, given the config of what it starts from.

    Planning is done in full on the first call of :meth:`steps` or :meth:`config`, so a
    bad instruction anywhere in the stage fails the stage before its first step runs.
    """

    def __init__(
        self,
        df: Dockerfile,
        stage: int,
        base_config: ImageConfig,
        build_args: Mapping[str, str],
        stage_names: Mapping[str, int],
        *,
        platform: Platform | None = None,
    ) -> None:
        if not 0 <= stage < len(df.stages):
            raise BuildError(f"{df.source}: there is no stage {stage}")
        self._df, self._index, self._base = df, stage, base_config
        self._names = stage_names
        # The platform ARGs (TARGETARCH, ...): the base image's, or this host's for scratch.
        self._platform = platform or base_config.platform or host_platform()
        env = base_config.env_map()
        env.setdefault("PATH", DEFAULT_PATH)  # BuildKit gives every stage a PATH (scratch, busybox-like bases)
        self._scope = Scope(df.escape, env, global_scope(df, build_args, self._platform), build_args)
        self._workdir = base_config.workdir
        self._user = base_config.user
        self._shell = base_config.shell or DEFAULT_SHELL
        self._shell_set = bool(base_config.shell)  # the config records a Shell only once there is one
        self._cmd, self._entrypoint, self._cmd_set = base_config.cmd, base_config.entrypoint, False
        self._labels = {key: value for key, _, value in (item.partition("=") for item in base_config.labels)}
        self._ports = dict.fromkeys(base_config.exposed_ports)
        self._volumes = dict.fromkeys(base_config.volumes)
        self._healthcheck = base_config.healthcheck
        self._stop_signal = base_config.stop_signal
        self._planned: list[Step] | None = None

    def steps(self) -> Iterator[Step]:
        """One step per instruction of the stage, in order."""
        return iter(self._plan())

    def config(self) -> ImageConfig:
        """The image config after every instruction of the stage (layers not included)."""
        self._plan()
        return ImageConfig(
            env=tuple(f"{k}={v}" for k, v in self._scope.env.items()),
            workdir=self._workdir,
            user=self._user,
            cmd=tuple(self._cmd),
            entrypoint=tuple(self._entrypoint),
            diff_ids=(),
            platform=self._base.platform,
            labels=tuple(f"{k}={v}" for k, v in self._labels.items()),
            exposed_ports=tuple(self._ports),
            volumes=tuple(self._volumes),
            healthcheck=tuple(self._healthcheck),
            stop_signal=self._stop_signal,
            shell=tuple(self._shell) if self._shell_set else (),
        )

    def _plan(self) -> list[Step]:
        if self._planned is None:
            self._planned = [self._step(ins) for ins in self._df.stages[self._index].instructions]
        return self._planned

    def _step(self, ins: Instruction) -> Step:
        handler = getattr(self, "_do_" + ins.keyword.lower())
        try:
            return handler(ins)
        except WordError as exc:  # the lexer's own complaint: a bad quote or ${...}
            raise self._fail(ins, str(exc)) from None

    def _fail(self, ins: Instruction, message: str) -> BuildError:
        return fail(self._df.source, ins, message)

    def _config(self, ins: Instruction, **fields: Any) -> ConfigStep:
        return ConfigStep(ins.line, ins.text, _key(ins.keyword, **fields))

    # --- variables -------------------------------------------------------------------------

    def _do_arg(self, ins: Instruction) -> Step:
        return self._config(ins, args=self._scope.arg(ins))

    def _do_env(self, ins: Instruction) -> Step:
        return self._config(ins, env=self._scope.set_env(ins))

    # --- the filesystem ----------------------------------------------------------------------

    def _do_run(self, ins: Instruction) -> Step:
        argv = exec_form(ins.rest)  # exec form: as is, no expansion (Docker expands neither form)
        if argv is None:
            argv = [*self._shell, ins.rest]  # the shell expands the command, not Docker
        if not argv:
            raise self._fail(ins, "needs a command")
        env, proxies = self._scope.run_env()
        workdir = self._workdir or "/"
        network = ins.flag("network")
        key = _key("RUN", argv=argv, env=env, workdir=workdir, user=self._user, network=network)
        return RunStep(ins.line, ins.text, key, tuple(argv), tuple(env + proxies), workdir, self._user, network)

    def _do_workdir(self, ins: Instruction) -> Step:
        path = self._scope.expand(ins.rest)
        if not path:
            raise self._fail(ins, f"{ins.rest!r} expands to nothing")
        self._workdir = absolute_path(self._workdir or "/", path)
        key = _key("WORKDIR", path=self._workdir, user=self._user)
        return WorkdirStep(ins.line, ins.text, key, self._workdir, self._user)

    def _do_copy(self, ins: Instruction) -> Step:
        add = ins.keyword == "ADD"
        from_stage = from_image = chown = chmod = checksum = None
        if (value := ins.flag("from")) is not None:  # not expanded, as in Docker
            source = resolve_from(self._df, ins, self._index, value, self._names)
            from_stage, from_image = (source, None) if isinstance(source, int) else (None, source)
        if (value := ins.flag("chown")) is not None:
            if not (chown := self._scope.expand(value)):
                raise self._fail(ins, f"--chown={value} expands to nothing")
        if (value := ins.flag("chmod")) is not None:
            chmod = self._scope.expand(value)
            if not _CHMOD.match(chmod):
                raise self._fail(ins, f"--chmod={chmod} is not an octal mode (e.g. 755 or 0644)")
        if (value := ins.flag("checksum")) is not None:
            checksum = self._scope.expand(value)
            if not _CHECKSUM.match(checksum):
                raise self._fail(ins, f"--checksum={checksum} is not sha256:<64 lower-case hex digits>")
        items = exec_form(ins.rest)
        if items is not None:  # JSON form: quotes are JSON's, but $VAR still expands
            items = [self._scope.expand(item, quotes=False) for item in items]
        else:
            items = expand_words(ins.rest, self._scope.variables(), self._df.escape)
        if len(items) < 2:
            raise self._fail(ins, "needs at least one source and a destination")
        sources, dest = items[:-1], items[-1]
        for src in sources:
            self._check_source(ins, add, src)
        if checksum is not None and (len(sources) != 1 or not _URL.match(sources[0])):
            raise self._fail(ins, "--checksum needs exactly one http(s) URL source")
        if not dest:
            raise self._fail(ins, "the destination is empty")
        absolute = absolute_path(self._workdir or "/", dest)
        into = dest.endswith("/") or posixpath.basename(dest) in (".", "..") or len(sources) > 1
        fields = dict(
            add=add,
            sources=sources,
            dest=absolute,
            dest_is_dir=into,
            from_stage=from_stage,
            from_image=from_image,
            chown=chown,
            chmod=chmod,
            checksum=checksum,
            user=self._user,
        )
        key = _key(ins.keyword, **fields)
        return CopyStep(
            ins.line,
            ins.text,
            key,
            add,
            tuple(sources),
            absolute,
            into,
            from_stage=from_stage,
            from_image=from_image,
            chown=chown,
            chmod=chmod,
            user=self._user,
            checksum=checksum,
        )

    _do_add = _do_copy

    def _check_source(self, ins: Instruction, add: bool, src: str) -> None:
        if not src:
            raise self._fail(ins, "a source is empty")
        lower = src.lower()
        if lower.startswith(("git@", "github.com/")) or (_URL.match(src) and _is_git(lower)):
            raise self._fail(ins, f"{src}: adding a git repository is not supported; clone it in a RUN instead")
        if _URL.match(src):
            if not add:
                raise self._fail(ins, f"{src}: COPY does not download; use ADD for a URL")
            if not lower.startswith(("http://", "https://")):
                raise self._fail(ins, f"{src}: ADD downloads only http and https URLs")

    # --- the config ----------------------------------------------------------------------------

    def _do_user(self, ins: Instruction) -> Step:
        self._user = self._scope.expand(ins.rest)
        return self._config(ins, user=self._user)

    def _do_shell(self, ins: Instruction) -> Step:
        self._shell = tuple(exec_form(ins.rest) or ())  # parse_dockerfile checked it is a JSON array
        self._shell_set = True
        return self._config(ins, shell=self._shell)

    def _command(self, ins: Instruction) -> tuple[str, ...]:
        argv = exec_form(ins.rest)
        return tuple(argv) if argv is not None else (*self._shell, ins.rest)

    def _do_cmd(self, ins: Instruction) -> Step:
        self._cmd, self._cmd_set = self._command(ins), True
        return self._config(ins, cmd=self._cmd)

    def _do_entrypoint(self, ins: Instruction) -> Step:
        self._entrypoint = self._command(ins)
        if not self._cmd_set:  # Docker: a new ENTRYPOINT drops the CMD inherited from the base
            self._cmd = ()
        return self._config(ins, entrypoint=self._entrypoint, cmd=self._cmd)

    def _do_label(self, ins: Instruction) -> Step:
        pairs = name_values(ins.rest, self._df.escape, self._scope.variables())
        self._labels.update(pairs)
        return self._config(ins, labels=pairs)

    def _do_maintainer(self, ins: Instruction) -> Step:
        # Docker records it as the image's Author (not expanded); the config has no such
        # field, so it becomes the label the documentation recommends instead.
        self._labels["maintainer"] = ins.rest
        return self._config(ins, labels=[("maintainer", ins.rest)])

    def _do_expose(self, ins: Instruction) -> Step:
        try:
            ports = exposed_ports(expand_words(ins.rest, self._scope.variables(), self._df.escape))
        except ValueError as exc:
            raise self._fail(ins, str(exc)) from None
        self._ports.update(dict.fromkeys(ports))
        return self._config(ins, ports=ports)

    def _do_volume(self, ins: Instruction) -> Step:
        items = exec_form(ins.rest)
        if items is not None:
            items = [self._scope.expand(item, quotes=False) for item in items]
        else:
            items = expand_words(ins.rest, self._scope.variables(), self._df.escape)
        try:
            added = volumes(items)
        except ValueError as exc:
            raise self._fail(ins, str(exc)) from None
        self._volumes.update(dict.fromkeys(added))
        return self._config(ins, volumes=added)

    def _do_stopsignal(self, ins: Instruction) -> Step:
        signal = self._scope.expand(ins.rest).strip()
        try:
            check_stop_signal(signal)
        except ValueError as exc:
            raise self._fail(ins, str(exc)) from None
        self._stop_signal = signal
        return self._config(ins, signal=signal)

    def _do_healthcheck(self, ins: Instruction) -> Step:
        try:
            self._healthcheck = healthcheck_test(ins.rest, bool(ins.flags))
        except ValueError as exc:
            raise self._fail(ins, str(exc)) from None
        return self._config(ins, test=self._healthcheck, flags=sorted(ins.flags))


def _is_git(url: str) -> bool:
    """A URL BuildKit's ADD would clone (``git://``, ``ssh://``, or a path ending in ``.git``)."""
    path = url.split("#", 1)[0].split("?", 1)[0].rstrip("/")
    return url.startswith(("git://", "ssh://", "git+")) or path.endswith(".git")
