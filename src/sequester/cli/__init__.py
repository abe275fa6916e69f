"""The ``sequester`` command: a thin layer over the library, one module per command.

:mod:`.entry` builds the parser and maps errors to exit statuses: 0 success; 1 the
program failed (``exec``), a property failed (``check``), a trial ended with an exception
(``run``); 2 bad input (a flag, the config file, a program file that cannot be read, a
task, an agent, the output folder, an image that cannot be had), with a message naming
it; 3 sequester itself could not do it here (no sandbox can be made, a sandbox failed to
start, a kernel died), with a message; 130 interrupted.
"""

from sequester.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
