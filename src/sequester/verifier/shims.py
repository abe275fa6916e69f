"""The runner's ``bin/``: small scripts in front of the real programs in ``libexec/``.

The test script's own shell runs with ``HOME`` in a private folder (so it sources
nothing the agent left in its home, such as the ``~/.local/bin/env`` that Terminal-Bench
scripts source after installing uv); the programs that run the tests (``uvx``, ``uv``,
``python3``) get the agent's ``HOME`` back, so the programs the tests start see the
home they expect. ``curl`` reads no ``.curlrc`` of the agent's. ``apt-get``/``apt``
never run the agent's apt: ``update`` does nothing; ``install`` of what the runner
provides succeeds; of what the host prepared from the script's install lines on the
task's pristine image (:mod:`sequester.imagebuild.apt_install`) unpacks it into the system
the tests run on (it runs nothing of the system's: not even its ``ldconfig``, which
the agent may have replaced); anything else fails (exit 100) and is told to the host as a
set-up failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from sequester.verifier import layout
from sequester.verifier.image_python import IMAGE_PYTHON_VAR, IMAGE_SITE_VAR
from sequester.verifier.pysite import LD_SAVED_VAR, PYTHONPATH_VAR, SITE_VAR
from sequester.verifier.pythons import HostPython

__all__ = ["write_shims", "BASH_ENV_TEXT", "FINGERPRINT"]

_HEAD = f"#!{layout.BIN}/bash\n# sequester verifier runner\n"
_AGENT_HOME = 'HOME="${SEQUESTER_AGENT_HOME:-$HOME}"; export HOME; unset SEQUESTER_AGENT_HOME\n'
# The runner's programs load no library by a path the script's environment names: an
# LD_LIBRARY_PATH the test script exported (into /app, the agent's) outranks a wheel's own
# $ORIGIN libraries, so a library the agent named like one loaded into the runner (red
# team). It is taken out for them and kept in pysite.LD_SAVED_VAR; the runner's Pythons
# give it back to the programs they start, which get what they would have in the
# container. (The tests' installed libraries need no variable: the runner's loaders search
# layout.TASK_LIBS after everything else, see tree.py.)
# Likewise a PYTHONPATH the script exported (red team: =/app put the agent's
# sitecustomize.py before the runner's): the runner's Pythons append it after their own
# folders (pysite.PYTHONPATH_VAR, as environ.py does with the image's) and give it back.
_RUNNER_ENV = (
    'if [ -n "${LD_LIBRARY_PATH+x}" ]; then '
    f'{LD_SAVED_VAR}="=$LD_LIBRARY_PATH"; export {LD_SAVED_VAR}; unset LD_LIBRARY_PATH; fi\n'
    'if [ -n "${PYTHONPATH+x}" ]; then '
    f'{PYTHONPATH_VAR}="${{{PYTHONPATH_VAR}:+${PYTHONPATH_VAR}:}}$PYTHONPATH"; export {PYTHONPATH_VAR}; '
    "unset PYTHONPATH; fi\n"
)

# Tell the host something on the runner's pipe (see sequester.verifier.pysite): a word per line.
_SAY = (
    "__sequester_say() {\n"
    '  case "${SEQUESTER_RUNNER_FD:-}" in ""|*[!0-9]*) ;;\n'
    '    *) printf \'%s\\n\' "$1" >&"$SEQUESTER_RUNNER_FD" ;;\n'
    "  esac 2>/dev/null\n"
    "}\n"
)

_APT = (
    _HEAD
    + _SAY
    + f'''cmd=; pkgs=(); skip=
for a in "$@"; do
  if [ -n "$skip" ]; then skip=; continue; fi
  case "$a" in
    -o|-c|-t|-a|--option|--config-file|--target-release|--default-release) skip=1 ;;
    -*) ;;
    *) if [ -z "$cmd" ]; then cmd=$a; else pkgs+=("$a"); fi ;;
  esac
done
prepared() {{
  [ -r {layout.TASK_INSTALLS}/packages ] || return 1
  while IFS= read -r q; do [ "$q" = "$1" ] && return 0; done < {layout.TASK_INSTALLS}/packages
  return 1
}}
case "$cmd" in
  update) echo "sequester: apt-get update skipped (the verifier installs from the task's image ahead)"; exit 0 ;;
  install)
    for p in "${{pkgs[@]}}"; do __sequester_say "installs:$p"; done
    unpack=
    for p in "${{pkgs[@]}}"; do
      if [ -x "{layout.BIN}/$p" ]; then continue; fi
      if prepared "$p"; then unpack=1; continue; fi
      __sequester_say "setup-failed:apt-get-install:$p"
      echo "E: Unable to locate package $p (the verifier installs only what it prepared from test.sh)" >&2; exit 100
    done
    if [ -n "$unpack" ]; then
      if ! {layout.BIN}/tar -xpf {layout.TASK_INSTALLS}/install.tar -C / \\
          --keep-directory-symlink --no-overwrite-dir; then
        for p in "${{pkgs[@]}}"; do __sequester_say "setup-failed:apt-get-install:$p"; done
        echo "E: the verifier could not unpack ${{pkgs[*]}}" >&2; exit 100
      fi
    fi
    echo "sequester: ${{pkgs[*]}} installed (by the verifier, with the task's image's own apt)"; exit 0 ;;
  *) __sequester_say "setup-failed:apt-get-$cmd"
     echo "E: apt-get $cmd is not available in the verifier" >&2; exit 100 ;;
esac
'''
)

# BASH_ENV of the runner's shells: a command not found is told to the host (a tool the
# script installed and then cannot find is its set-up failing, not the agent's 0).
BASH_ENV_TEXT = (
    _SAY
    + "command_not_found_handle() {\n"
    + '  __sequester_say "not-found:$1"; printf \'%s: command not found\\n\' "$1" >&2; return 127\n'
    + "}\n"
)


def _pip_env(python: object) -> str:
    """The shell functions of the runner's pip environment :data:`layout.RUN_PIP`: made
    before the script runs from its own pip lines (:mod:`.ahead`, which names it with
    ``SEQUESTER_PIP_ENV`` then), from ``python``, offline, from the runner's and the task's
    wheels; read-only once the script runs. Nothing else is ever the runner's pip
    environment (a folder the script's programs could write first never is)."""
    return (
        # __sequester_pip: the environment, when there is one
        "__sequester_pick() { __sequester_pip=\n"
        f"  [ -x {layout.RUN_PIP}/bin/python ] && __sequester_pip={layout.RUN_PIP}; }}\n"
        # What `pip install` takes that uv pip does not (or need not): left out.
        "__sequester_args() { __args=()\n"
        '  for a in "$@"; do\n'
        '    case "$a" in\n'
        "      --break-system-packages|--user|--no-cache-dir|--root-user-action=*|--disable-pip-version-check) ;;\n"
        "      --no-warn-script-location|-q|--quiet|-U|--upgrade) ;;\n"
        '      *) __args+=("$a") ;;\n'
        "    esac\n"
        "  done\n"
        "}\n"
        '__sequester_venv() { [ -x "$SEQUESTER_PIP_ENV/bin/python" ] || '
        f'{layout.LIBEXEC}/uv venv -q --python {python} "$SEQUESTER_PIP_ENV"; }}\n'
        "__sequester_pytest() {\n"
        '  __sequester_pick; [ -n "$__sequester_pip" ] && [ -x "$__sequester_pip/bin/pytest" ]\n'
        "}\n"
    )


# The script asked for pytest (``pytest``, ``python3 -m pytest``, ``python3 -m pip``): the
# pip environment, with the runner's pinned pytest unless the script installed one (both
# installed before the script ran, when its text asks for them).
_ENSURE = (
    "__sequester_pytest || "
    '{ __sequester_say "setup-failed:pytest-install"; '
    "echo \"sequester: the verifier has no pytest for this (the script's text names none it could install "
    'before running)" >&2; exit 1; }'
)

# pip: a `pip install` line of the script's own text was installed before it ran (by this
# program, with SEQUESTER_PIP_ENV naming the runner's environment: its uv, offline, from
# the runner's and the task's wheels): it is done. Any other is refused, a set-up
# failure. None of the agent's pip, pip.conf or PIP_* is read.
_PIP = f"""sub=${{1:-}}; [ $# -gt 0 ] && shift
case "$sub" in
  install) ;;
  --version|-V) echo "pip (the sequester verifier's: uv pip)"; exit 0 ;;
  list|freeze|show) __sequester_pick
    exec {layout.LIBEXEC}/uv pip "$sub" --python "${{__sequester_pip:-$real}}/bin/python" "$@" ;;
  *) __sequester_say "setup-failed:pip-$sub"; echo "sequester: pip $sub is not available in the verifier" >&2; exit 1 ;;
esac
for a in "$@"; do
  case "$a" in -*) ;; *) n=${{a%%[=<>!~;[ ]*}}; __sequester_say "installs:$n" ;; esac
done
__line=$(IFS=$'\x1f'; printf '%s' "$*")
if [ -r {layout.PIP_LINES} ]; then
  while IFS= read -r __l; do
    if [ "$__l" = "$__line" ]; then echo "sequester: installed before the script ran: $*"; exit 0; fi
  done < {layout.PIP_LINES}
fi
if [ -z "${{SEQUESTER_PIP_ENV:-}}" ]; then
  __sequester_say "setup-failed:pip-install:not-read-ahead"
  echo "sequester: pip install $* was not read from the test script before it ran (a word the shell expands?): \
the verifier installs only what it installs then" >&2
  exit 1
fi
__sequester_venv || exit 1
__sequester_args "$@"
exec {layout.LIBEXEC}/uv pip install --python "$SEQUESTER_PIP_ENV/bin/python" "${{__args[@]}}"
"""

# uvx: a command installed before the script ran (sequester.verifier.ahead) runs from its
# environment, as uvx runs it (its bin first on PATH, UV set); one whose install failed
# then (its folder "-") is a set-up failure, never made as the script runs (red team: an
# agent that made the install fail had it made where its own program could write);
# another is made as the script runs, in the scratch folder (told to the host).
_UVX_AHEAD = f"""if [ -r {layout.TOOL_INDEX} ]; then
  while IFS=$'\t' read -r __b __c __ws; do
    IFS=$'\x1f' read -r -a __w <<< "$__ws"
    __n=${{#__w[@]}}
    [ "$__n" -gt 0 ] && [ $# -ge "$__n" ] || continue
    __i=0; __ok=1
    for __x in "${{__w[@]}}"; do __i=$((__i + 1)); [ "${{!__i}}" = "$__x" ] || {{ __ok=; break; }}; done
    [ -n "$__ok" ] || continue
    if [ "$__b" = - ] || [ ! -x "$__b/$__c" ]; then
      __sequester_say "setup-failed:uvx-ahead"
      echo "sequester: the verifier could not install this uvx tool before the script ran (its output says why)" >&2
      exit 1
    fi
    shift "$__n"; PATH="$__b:$PATH"; UV={layout.LIBEXEC}/uv; export PATH UV
    {_AGENT_HOME.strip()}
    {_RUNNER_ENV.strip()}
    exec "$__b/$__c" "$@"
  done < {layout.TOOL_INDEX}
fi
__sequester_say "runner-unsealed:uvx"
"""

# `python -S` (no site): the runner's Python would run without its sitecustomize, so with
# none of its guards (the working folder first on sys.path, CPython's own find_library
# running the view's ldconfig: red team). Refused, as a set-up failure the host settles
# (an error, never the agent's 0), unless -I is given too (isolated: nothing of the working
# folder, PYTHONPATH or the user site on sys.path; sequester's own build steps run so):
# the interpreter's options are read up to the script, -c or -m; -W and -X take a value.
_NO_DASH_S = """__skip=; __dash_s=; __iso=
for __a in "$@"; do
  if [ -n "$__skip" ]; then __skip=; continue; fi
  case "$__a" in
    -W|-X|--check-hash-based-pycs) __skip=1 ;;
    --) break ;;
    --*) ;;
    -?*) __o=${__a#-}
      while [ -n "$__o" ]; do
        __ch=${__o%"${__o#?}"}; __o=${__o#?}
        case "$__ch" in
          S) __dash_s=1 ;;
          I) __iso=1 ;;
          c|m) break 2 ;;
          W|X) [ -z "$__o" ] && __skip=1; break ;;
        esac
      done ;;
    *) break ;;
  esac
done
if [ -n "$__dash_s" ] && [ -z "$__iso" ]; then
  __sequester_say "setup-failed:python-S"
  echo "sequester: python -S is not available in the verifier (its Python keeps the agent's modules out through \
its site; with -I it is)" >&2; exit 2
fi
"""

# What the tree's stamp includes (see sequester.verifier.tree): a change of a shim is a new tree.
FINGERPRINT = (
    _APT
    + _RUNNER_ENV
    + _NO_DASH_S
    + BASH_ENV_TEXT
    + _PIP
    + _ENSURE
    + _pip_env("")
    + _UVX_AHEAD
    + "python3: the image's version when the runner has it; uv's runtime installs told"
    + "uvx: the Python asked is checked before the tools installed ahead"
)


def _asks_python(shorts: list[str]) -> str:
    """Shell text that says ``setup-failed:uv-python:X.Y`` on the runner's pipe when uv is
    asked (``-p``, ``--python``) for a CPython version none of ``shorts`` is."""
    have = " ".join(shorts)
    return (
        "__sequester_want=; __sequester_next=\n"
        'for a in "$@"; do\n'
        '  if [ -n "$__sequester_next" ]; then __sequester_want=$a; __sequester_next=; continue; fi\n'
        '  case "$a" in -p|--python) __sequester_next=1 ;; --python=*) __sequester_want=${a#--python=} ;;'
        " -p?*) __sequester_want=${a#-p} ;; esac\n"
        "done\n"
        'case "$__sequester_want" in\n'
        "  [0-9]*.[0-9]*)\n"
        '    __sequester_short=$(printf %s "$__sequester_want" | cut -d. -f1,2)\n'
        f'    case " {have} " in *" $__sequester_short "*) ;; *) __sequester_say "setup-failed:uv-python:$__sequester_want" ;; esac ;;\n'  # noqa: E501 - a program's text
        "esac\n"
    )


def _real(py: HostPython) -> str:
    return str(layout.PYTHONS / py.dir_name / "bin" / f"python{py.short}")


def _script(path: Path, body: str) -> None:
    path.write_text(_HEAD + body)
    os.chmod(path, 0o755)


def write_shims(root: Path, *, tools: Iterable[str], pythons: list[HostPython], has_uvx: bool) -> None:
    bin_dir = root / "bin"
    for name in tools:
        if name == "curl":
            # Trust only the host's CA bundle, copied into the tree when it was built: the
            # view's bundle, and /etc/hosts naming a server of the agent's, decide nothing.
            _script(
                bin_dir / "curl",
                f"CURL_HOME={layout.RUN_HOME}; export CURL_HOME\n"
                f'exec {layout.LIBEXEC}/curl --cacert {layout.ETC}/ca-certificates.crt "$@"\n',
            )
        else:
            os.symlink(f"../libexec/{name}", bin_dir / name)
    os.symlink("bash", bin_dir / "sh")
    # A Python the runner does not have (uv venv -p 3.12, uvx -p 3.12): told to the host as
    # a set-up failure (an error after the pristine re-run, never the agent's 0), then uv
    # fails as it would.
    asks = _asks_python(sorted({py.short for py in pythons}))
    # uv itself (uv venv, uv pip install, uv run): nothing of it is installed ahead; what it
    # installs goes into the scratch folder's cache as the script runs (told to the host).
    unsealed = (
        'case "${1:-}" in ""|-V|--version|version|help|-h|--help) ;; *) __sequester_say "runner-unsealed:uv" ;; esac\n'
    )
    _script(bin_dir / "uv", _SAY + unsealed + asks + _AGENT_HOME + _RUNNER_ENV + f'exec {layout.LIBEXEC}/uv "$@"\n')
    uvx = f"{layout.LIBEXEC}/uvx" if has_uvx else f"{layout.LIBEXEC}/uv tool run"
    # Tell the host uvx started (see sequester.environments.local.evaluation: a run where uvx
    # started and pytest never did is a failed bootstrap, not the agent's 0).
    said = 'case "${SEQUESTER_RUNNER_FD:-}" in ""|*[!0-9]*) ;; *) printf \'uvx\\n\' >&"$SEQUESTER_RUNNER_FD" ;; esac 2>/dev/null\n'  # noqa: E501 - a program's text
    # (the Python asked is checked first: a version the runner lacks is the failure named,
    # not the tool that could not be installed ahead for it)
    _script(bin_dir / "uvx", said + _SAY + asks + _UVX_AHEAD + _AGENT_HOME + _RUNNER_ENV + f'exec {uvx} "$@"\n')
    # python3, python, pip and pytest: the image's python3 version when the runner has it
    # (IMAGE_PYTHON_VAR, see sequester.verifier.image_python), else the first Python; their
    # Pythons find the image's packages after their own (pysite's SITE_VAR).
    select = "real=" + _real(pythons[0]) + "\n"
    if len(pythons) > 1:
        cases = "".join(f"  {py.short}) real={_real(py)} ;;\n" for py in pythons)
        select += f'case "${{{IMAGE_PYTHON_VAR}:-}}" in\n{cases}esac\n'
    select += f'{SITE_VAR}="${{{IMAGE_SITE_VAR}:-}}"; export {SITE_VAR}\n'
    for py in pythons:
        name = f"python{py.short}"
        # By absolute path: Python finds its standard library next to the binary it was
        # started as, never at the build's compiled-in prefix (a path of the view).
        _script(bin_dir / name, _SAY + _NO_DASH_S + _AGENT_HOME + _RUNNER_ENV + f'exec {_real(py)} -s "$@"\n')
    default = (
        f'if [ "$1 $2" = "-m pytest" ] || [ "$1 $2" = "-m pip" ]; then {_ENSURE}; fi\n'
        "__sequester_pick\n"
        'if [ -n "$__sequester_pip" ]; then exec "$__sequester_pip/bin/python" -s "$@"; fi\n'
        'exec "$real" -s "$@"\n'
    )
    for name in ("python3", "python"):
        _script(bin_dir / name, select + _SAY + _NO_DASH_S + _pip_env('"$real"') + _AGENT_HOME + _RUNNER_ENV + default)
    pip = select + _SAY + _pip_env('"$real"') + _RUNNER_ENV + _PIP
    for name in ("pip", "pip3"):
        _script(bin_dir / name, pip)
    pytest = (
        select
        + _SAY
        + _pip_env('"$real"')
        + _ENSURE
        + "\n"
        + _AGENT_HOME
        + _RUNNER_ENV
        + 'exec "$__sequester_pip/bin/pytest" "$@"\n'
    )
    for name in ("pytest", "py.test"):
        _script(bin_dir / name, pytest)
    (root / "etc" / "bash-env").write_text(BASH_ENV_TEXT)
    (bin_dir / "apt-get").write_text(_APT)
    os.chmod(bin_dir / "apt-get", 0o755)
    os.symlink("apt-get", bin_dir / "apt")
    # What TB2 scripts source after the uv installer: put the runner's tools first again.
    (root / "etc" / "uv-env").write_text(f'export PATH="{layout.BIN}:$PATH"\n')
    (root / "etc" / "pytest.ini").write_text("[pytest]\n")
