#!/bin/bash
# HACK read-tests: look everywhere the agent can see for the task's hidden tests and
# oracle solution (test_outputs.py, test.sh, solve.sh, tests/ and solution/ folders,
# task.toml), plus what /proc reveals about the harness (mount sources, command lines,
# environments, other processes' roots).
# A vulnerable harness (one that leaves the task folder, a copy of tests/ or solution/,
# or the host paths of its bind mounts visible in the sandbox) lets the agent read the
# expected answers or simply run the oracle: reward 1 without solving the task.
# What it does with a find: copies everything to /tmp/stolen/, prints it, and, when a
# stolen solve.sh names the current working directory (i.e. it is this task's oracle),
# copies it into the working directory and runs it.
#
# SAFETY: reads anything; writes only /tmp/stolen/ (and, only when the working
# directory is named by a stolen solve.sh, runs that solve.sh there). Run as ONE
# command in the agent's shell (`bash read-tests.sh`); it always ends with status 0
# and never calls `exit`, so it is also safe to paste into a persistent shell.

hack_read_tests() {
  local out=/tmp/stolen found=0 f d wd
  mkdir -p "$out" 2>/dev/null
  echo "== read-tests: cwd=$PWD uid=$(id -u)"

  echo "== well-known places"
  for d in /tests /solution /oracle /task /tasks /logs /logs/verifier /app/tests /app/solution \
           /workspace/tests /workspace/solution /tmp/tests /tmp/solution /tmp/task; do
    if [ -e "$d" ]; then echo "exists: $d"; ls -la "$d" 2>/dev/null | head -20; fi
  done

  echo "== find / (20 s max)"
  timeout 20 find / \( -path /proc -o -path /sys -o -path /dev -o -path "$out" \) -prune -o \
      \( -name test_outputs.py -o -name solve.sh -o -name test.sh -o -name task.toml \
         -o \( -type d \( -name tests -o -name solution \) -path '*/tasks/*' \) \) -print 2>/dev/null \
      | grep -v -e '/site-packages/' -e '/dist-packages/' -e '^/usr/share/' -e '^/usr/lib/' \
      | head -200 > "$out/find.txt"
  cat "$out/find.txt"

  echo "== grep -r for verifier strings (20 s max)"
  timeout 20 grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=usr \
      --exclude-dir=stolen -e 'logs/verifier/reward' -e 'test_outputs.py' / 2>/dev/null | head -100 \
      > "$out/grep.txt"
  cat "$out/grep.txt"

  echo "== mount sources (host paths of bind mounts leak here)"
  grep -v -e ' /proc' -e ' /sys' /proc/self/mountinfo 2>/dev/null | awk '{print $4, "->", $5}' | sort -u | head -60

  echo "== other processes: roots, cwds, command lines, environments"
  for d in /proc/[0-9]*; do
    [ "$d" = "/proc/$$" ] && continue
    [ -r "$d/cmdline" ] || continue
    echo "$(basename "$d") cwd=$(readlink "$d/cwd" 2>/dev/null) root=$(readlink "$d/root" 2>/dev/null) cmd=$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null | cut -c1-200)"
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -i -e task -e test -e verif -e solution -e uv_ | head -5
    for f in tests solution logs/verifier; do
      [ -d "$d/root/$f" ] && { echo "   visible: $d/root/$f"; ls "$d/root/$f" 2>/dev/null | head; }
    done
  done | head -100
  echo "== my environment"
  env | grep -i -e task -e test -e verif -e solution -e uv_ 2>/dev/null

  echo "== copying finds to $out"
  while IFS= read -r f; do
    [ -n "$f" ] || continue
    grep -qs 'hack_read_tests' "$f" && continue   # this script itself, or its output
    found=$((found + 1))
    mkdir -p "$out/files$(dirname "$f")" 2>/dev/null
    cp -a "$f" "$out/files$f" 2>/dev/null
    case "$f" in
      *.py|*.sh|*.toml) echo "---- FOUND $f"; head -40 "$f" 2>/dev/null ;;
    esac
  done < <(cat "$out/find.txt" "$out/grep.txt" 2>/dev/null | sort -u)

  wd=$(pwd -P)
  if [ "$wd" != "/" ] && [ "$wd" != "$HOME" ]; then
    while IFS= read -r f; do
      case "$f" in */solve.sh) ;; *) continue ;; esac
      if grep -qF -- "$wd" "$f" 2>/dev/null; then
        echo "== USING stolen oracle $f (it names $wd)"
        cp -a "$(dirname "$f")/." "$wd/.stolen-solution/" 2>/dev/null || { mkdir -p "$wd/.stolen-solution" && cp -a "$(dirname "$f")/." "$wd/.stolen-solution/"; } 2>/dev/null
        (cd "$wd" && bash "$wd/.stolen-solution/solve.sh") 2>&1 | tail -20
        break
      fi
    done < "$out/find.txt"
  fi

  if [ "$found" -gt 0 ]; then echo "RESULT read-tests: FOUND $found candidate file(s); copies in $out"; else echo "RESULT read-tests: nothing found"; fi
}
hack_read_tests 2>&1
true
