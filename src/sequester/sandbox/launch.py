"""Kept so that ``sequester.sandbox.launch.run_confined`` (the path the 0.1 README gave)
goes on working: kernels are launched by :mod:`sequester.kernel.launch` now. Loaded
lazily, so the sandbox package never imports the kernel's."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

_NAMES = ("launch_kernel", "run_confined", "run_in_sandbox")


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        from sequester.kernel import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
