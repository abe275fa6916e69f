"""The wire protocol of ``sequester serve``: OpenEnv's frames, sequester's actions. Pure.

Client frames (JSON text)::

    {"type": "reset", "data": {"task": "python-csv-stats"}}   # an episode session
    {"type": "reset", "data": {"kind": "kernel"}}             # a kernel session
    {"type": "step", "data": <action>}
    {"type": "state"}
    {"type": "close"}

Server frames: ``observation`` (``{"observation": {...}, "reward": x, "done": b}``),
``state``, ``error`` (``{"message", "code"}``) and, for clients that ask for it at reset,
``progress`` (``{"elapsed_s": x}``) while a long step runs.

Everything a client sends is untrusted: a frame is parsed here once, strictly (no NaN, no
coercion of wrong types, no unknown fields), and every refusal names the field, never
echoing the input (a 16 MiB value must not come back in the error, nor reach a log).
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

__all__ = [
    "ErrorCode",
    "FrameError",
    "ClientFrame",
    "parse_frame",
    "parse_json",
    "parse_action",
    "parse_reset",
    "Action",
    "Observation",
    "SessionState",
    "schemas",
    "error_text",
    "observation_frame",
    "state_frame",
    "error_frame",
    "progress_frame",
    "encode_frame",
]  # and the models

MAX_TIMEOUT = 86_400.0  # a day: beyond it a number is a mistake (or an overflow attempt)
MAX_PATH = 4096
_MAX_ERRORS = 5  # validation errors listed in one message


class ErrorCode(str, enum.Enum):
    """OpenEnv's error codes (``openenv.core.env_server.types.WSErrorCode``), kept as they are."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


class FrameError(Exception):
    """A frame (or an action in it) refused: answered with an ``error`` frame of ``code``."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# -- strings ---------------------------------------------------------------------------------


def _unicode(text: str) -> str:
    # A lone surrogate ("\ud800" is valid JSON) cannot be encoded: refused here, not as a
    # crash in the shell's or the file writer's encode() halfway through a step.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (it holds a lone surrogate)") from None
    return text


def _no_nul(text: str) -> str:
    # A NUL ends a C string: a path or a command with one would mean something else below.
    if "\x00" in text:
        raise ValueError("must not contain NUL characters")
    return text


Text = Annotated[str, AfterValidator(_unicode)]
Command = Annotated[str, AfterValidator(_unicode), AfterValidator(_no_nul)]
FilePath = Annotated[str, Field(min_length=1, max_length=MAX_PATH), AfterValidator(_unicode), AfterValidator(_no_nul)]
Timeout = Annotated[float | None, Field(default=None, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False)]
Encoding = Literal["utf-8", "base64"]


class _In(BaseModel):
    # strict: "5" is not a number and 1 is not a string; forbid: a misspelt field is named,
    # not silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Action(_In):
    # OpenEnv's Action base model has a metadata dict, which its typed clients send along.
    metadata: dict[str, Any] = Field(default_factory=dict, description="ignored (OpenEnv's Action.metadata)")


class ExecAction(_Action):
    """A command in the episode's persistent shell (``Episode.exec``)."""

    type: Literal["exec"]
    command: Command
    timeout: Timeout = None


class WriteFileAction(_Action):
    """A file in the agent's view, parent folders made (``Episode.write_file``)."""

    type: Literal["write_file"]
    path: FilePath
    content: Text
    encoding: Encoding = "utf-8"
    mode: int = Field(default=0o644, ge=0, le=0o7777)

    @model_validator(mode="after")
    def _decodable(self) -> WriteFileAction:
        if self.encoding == "base64":
            try:
                base64.b64decode(self.content, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("content: is not valid base64") from None
        return self

    def data(self) -> bytes:
        return base64.b64decode(self.content) if self.encoding == "base64" else self.content.encode("utf-8")


class ReadFileAction(_Action):
    """A file of the agent's view (``Episode.read_file``), its first ``limit`` bytes."""

    type: Literal["read_file"]
    path: FilePath
    encoding: Encoding = "utf-8"
    limit: int | None = Field(default=None, ge=0)


class EvaluateAction(_Action):
    """Run the task's pristine tests where only the verifier sees them; ends the episode."""

    type: Literal["evaluate"]


CheckpointId = Annotated[str, Field(min_length=3, max_length=128, pattern=r"^[0-9a-f]+-[0-9a-f]+$")]


class CheckpointAction(_Action):
    """Seal the episode's files and go on from them (``EpisodePool.checkpoint``): the shell
    restarts with its working directory and exports; other processes are named as not
    restored. The checkpoint lives until released or until this session closes."""

    type: Literal["checkpoint"]


class RollbackAction(_Action):
    """Start the episode again on a checkpoint (this session's, or one a fork came from)."""

    type: Literal["rollback"]
    checkpoint: CheckpointId


class ReleaseAction(_Action):
    """Let a checkpoint go (episodes started on it keep its layers)."""

    type: Literal["release"]
    checkpoint: CheckpointId


class CellAction(_Action):
    """A code cell in the session's kernel (``Kernel.run``)."""

    type: Literal["cell"]
    code: Text
    timeout: Timeout = None


Action = Annotated[
    ExecAction
    | WriteFileAction
    | ReadFileAction
    | EvaluateAction
    | CheckpointAction
    | RollbackAction
    | ReleaseAction
    | CellAction,
    Field(discriminator="type"),
]
EPISODE_ACTIONS = frozenset({"exec", "write_file", "read_file", "evaluate", "checkpoint", "rollback", "release"})
KERNEL_ACTIONS = frozenset({"cell"})
ACTION_TYPES = ("exec", "write_file", "read_file", "evaluate", "checkpoint", "rollback", "release", "cell")
_ACTION = TypeAdapter(Action)


class _ResetCommon(_In):
    progress: bool = Field(default=False, description="send progress frames while a step runs (see the README)")
    # OpenEnv's ResetRequest fields: accepted and ignored (a task's episode is what it is).
    seed: int | None = Field(default=None, ge=0)
    episode_id: str | None = Field(default=None, max_length=255)


class EpisodeReset(_ResetCommon):
    """A task's episode, or (``checkpoint``) a fork of a checkpoint another session made:
    a new session of that task, counted against ``max_sessions``."""

    kind: Literal["episode"] = "episode"
    task: (
        Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(_unicode), AfterValidator(_no_nul)] | None
    ) = None
    checkpoint: CheckpointId | None = None

    @model_validator(mode="after")
    def _one(self) -> EpisodeReset:
        if (self.task is None) == (self.checkpoint is None):
            raise ValueError("task: give a task, or a checkpoint to fork (one of the two)")
        return self


class KernelReset(_ResetCommon):
    kind: Literal["kernel"]


# -- observations (what the server sends; extra="forbid" keeps the schemas exact) ------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResetObservation(_Out):
    session_id: str
    kind: Literal["episode", "kernel"]
    task: str | None = None
    instruction: str | None = None
    workdir: str | None = None
    # The task's calibration here (sequester.calibration): its state ("calibrated",
    # "uncalibrated"; "off" not asked) and, uncalibrated, why.
    calibration: dict[str, Any] | None = None


class ExecObservation(_Out):
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration: float
    note: str = ""


class WriteFileObservation(_Out):
    path: str
    bytes: int


class ReadFileObservation(_Out):
    content: str
    encoding: Encoding
    truncated: bool


class VerifierObservation(_Out):
    """The verdict, never the tests' output: observations may be forwarded to the model,
    and what the tests printed would teach it the tests."""

    reward: float | None
    rewards: dict[str, float]
    zero_reason: str | None
    tampering: list[str]
    notes: list[str]
    error: str | None


class EvaluateObservation(_Out):
    verifier: VerifierObservation


class CheckpointObservation(_Out):
    checkpoint: str
    depth: int
    bytes: int
    not_restored: list[str]


class RollbackObservation(_Out):
    checkpoint: str
    workdir: str | None = None


class ReleaseObservation(_Out):
    checkpoint: str
    released: bool


class CellErrorModel(_Out):
    type: str
    message: str
    traceback: str = ""


class CellObservation(_Out):
    stdout: str
    stderr: str
    value: str | None
    error: CellErrorModel | None
    duration: float
    timed_out: bool
    restarted: bool


Observation = Union[  # noqa: UP007 - pydantic reads this alias at run time
    ResetObservation,
    ExecObservation,
    WriteFileObservation,
    ReadFileObservation,
    EvaluateObservation,
    CheckpointObservation,
    RollbackObservation,
    ReleaseObservation,
    CellObservation,
]


class SessionState(_Out):
    """A ``state`` frame: the connection's session (all null before a reset)."""

    session_id: str | None = None
    kind: Literal["episode", "kernel"] | None = None
    task: str | None = None
    steps: int = 0
    done: bool = False
    started_at: float | None = Field(default=None, description="Unix time of the reset")


def schemas() -> dict[str, Any]:
    """``GET /schema``: JSON schemas of an action, an observation and a session's state."""
    return {
        "action": _ACTION.json_schema(),
        "observation": TypeAdapter(Observation).json_schema(),
        "state": SessionState.model_json_schema(),
    }


# -- parsing -----------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str | bytes) -> Any:
    """JSON as the standard says it (no NaN/Infinity); :class:`FrameError` otherwise."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # [[[[... : the C parser stops at the recursion limit
        raise FrameError(ErrorCode.INVALID_JSON, "invalid JSON: nested too deeply") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, a 5,000-digit integer, bad bytes
        raise FrameError(ErrorCode.INVALID_JSON, f"invalid JSON: {str(exc)[:200]}") from None


@dataclass(frozen=True)
class ClientFrame:
    type: Literal["reset", "step", "state", "close"]
    data: dict[str, Any]


_CLIENT_TYPES = ("reset", "step", "state", "close")


def parse_frame(text: str) -> ClientFrame:
    """One client frame, checked down to the envelope (``data`` is checked by its user)."""
    frame = parse_json(text)
    if not isinstance(frame, dict):
        raise FrameError(ErrorCode.VALIDATION_ERROR, f"a frame is a JSON object with a 'type', not {_kind(frame)}")
    kind = frame.get("type")
    if not isinstance(kind, str):
        raise FrameError(ErrorCode.VALIDATION_ERROR, "type: missing or not a string (one of reset, step, state, close)")
    if kind not in _CLIENT_TYPES:
        raise FrameError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind[:40]!r} (one of reset, step, state, close)"
        )
    extra = sorted(str(k)[:40] for k in frame if k not in ("type", "data"))
    if extra:
        raise FrameError(ErrorCode.VALIDATION_ERROR, f"{extra[0]}: not a field of a frame (type, data)")
    data = frame.get("data")
    if data is None and kind != "step":
        data = {}
    if not isinstance(data, dict):
        raise FrameError(
            ErrorCode.VALIDATION_ERROR,
            f"data: {'missing' if data is None else 'not an object'}"
            + (" (a step's data is its action)" if kind == "step" else ""),
        )
    return ClientFrame(kind, data)  # type: ignore[arg-type]


def parse_action(
    data: dict[str, Any], where: str = "data"
) -> (
    ExecAction
    | WriteFileAction
    | ReadFileAction
    | EvaluateAction
    | CheckpointAction
    | RollbackAction
    | ReleaseAction
    | CellAction
):
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in ACTION_TYPES:
        said = (
            "missing"
            if kind is None
            else (f"{kind[:40]!r} is not an action" if isinstance(kind, str) else "not a string")
        )
        raise FrameError(ErrorCode.VALIDATION_ERROR, f"{where}.type: {said} (one of {', '.join(ACTION_TYPES)})")
    try:
        return _ACTION.validate_python(data)
    except ValidationError as exc:
        raise FrameError(ErrorCode.VALIDATION_ERROR, error_text(exc, where, tag=kind)) from None


def parse_reset(data: dict[str, Any], where: str = "data") -> EpisodeReset | KernelReset:
    kind = data.get("kind", "episode")
    model: type[EpisodeReset | KernelReset]
    if kind == "episode":
        model = EpisodeReset
    elif kind == "kernel":
        model = KernelReset
    else:
        raise FrameError(ErrorCode.VALIDATION_ERROR, f"{where}.kind: must be 'episode' (the default) or 'kernel'")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise FrameError(ErrorCode.VALIDATION_ERROR, error_text(exc, where)) from None


def error_text(exc: ValidationError, where: str, *, tag: str | None = None) -> str:
    """``data.command: Input should be a valid string; ...``: each field named, no input echoed."""
    parts = []
    for error in exc.errors(include_input=False, include_url=False, include_context=False)[:_MAX_ERRORS]:
        loc = [str(p) for p in error["loc"]]
        if tag is not None and loc[:1] == [tag]:
            loc = loc[1:]  # the discriminated union's own level
        field = ".".join([where, *loc])
        message = str(error["msg"])
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
            if ": " in message and loc == []:  # a model validator's "content: ..." names its field
                name, message = message.split(": ", 1)
                field = f"{where}.{name}"
        parts.append(f"{field}: {message}")
    more = exc.error_count() - _MAX_ERRORS
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


# -- server frames -------------------------------------------------------------------------


def observation_frame(observation: BaseModel, reward: float | None = None, done: bool = False) -> dict[str, Any]:
    return {
        "type": "observation",
        "data": {"observation": observation.model_dump(mode="json"), "reward": reward, "done": done},
    }


def state_frame(state: SessionState) -> dict[str, Any]:
    return {"type": "state", "data": state.model_dump(mode="json")}


def error_frame(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code.value}}


def progress_frame(elapsed_s: float) -> dict[str, Any]:
    return {"type": "progress", "data": {"elapsed_s": round(elapsed_s, 3)}}


def encode_frame(frame: dict[str, Any]) -> str:
    """JSON text for a frame; ASCII-escaped only if it holds text UTF-8 cannot carry (an
    exception message quoting a surrogate-escaped file name)."""
    text = json.dumps(frame, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(frame, ensure_ascii=True, allow_nan=False)
    return text
