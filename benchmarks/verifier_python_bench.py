"""The verifier's Pythons against the task image's own, on one loop benchmark, in one run.

    python benchmarks/verifier_python_bench.py [--config CONFIG] [--image python:3.13-slim-bookworm] [--runs 3]

A task on ``--image`` (its Dockerfile ``FROM`` that image, fetched by the config's
``[images]`` settings) runs a CPU-bound loop (20 million additions and modulos, the kind
of work time-limited tests do):

* in the agent's shell, with the image's own ``python3`` (the reference: what the tests'
  author timed under Docker);
* in the verifier, with ``uvx -p 3.13 python`` (the runner's 3.13) and ``python3`` (the
  runner's Python of the image's version);
* on the host, with every other 3.13 the host has (a pyenv build: what the runner used
  before it took Debian's).

Target: the runner's 3.13 no slower than 1.1 times the image's. Each figure is the
median of ``--runs``; the loop times itself (start-up excluded).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import report

from sequester.config import load_config
from sequester.environments.local.episode import Episode
from sequester.verifier.pythons import host_builds

LOOP = """import time
t = time.perf_counter()
s = 0
for i in range(20_000_000):
    s += i * i % 7
print(round(time.perf_counter() - t, 3))
"""


def task(root: Path, image: str, runs: int) -> Path:
    t = root / "python-bench"
    for sub in ("tests", "environment", "solution"):
        (t / sub).mkdir(parents=True)
    (t / "instruction.md").write_text("Nothing to do.\n")
    (t / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 600\n')
    (t / "environment" / "Dockerfile").write_text(f"FROM {image}\nWORKDIR /app\n")
    (t / "solution" / "solve.sh").write_text("true\n")
    (t / "tests" / "loop.py").write_text(LOOP)
    lines = [f"for i in $(seq {runs}); do uvx -p 3.13 python /tests/loop.py >> /logs/verifier/uvx.txt; done",
             f"for i in $(seq {runs}); do python3 /tests/loop.py >> /logs/verifier/python3.txt; done",
             "python3 -c 'import sys; print(sys.version)' > /logs/verifier/version.txt",
             "uvx -p 3.13 python -c 'import sys; print(sys.version)' >> /logs/verifier/version.txt",
             "echo 1 > /logs/verifier/reward.txt"]
    (t / "tests" / "test.sh").write_text("\n".join(lines) + "\n")
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None, help="a sequester config whose [images] can fetch --image")
    parser.add_argument("--image", default="python:3.13-slim-bookworm")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    settings = load_config(args.config).episodes
    med = lambda xs: statistics.median(xs)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="seq-py-bench-") as tmp:
        t = task(Path(tmp), args.image, args.runs)
        (Path(tmp) / "loop.py").write_text(LOOP)
        with Episode(settings) as ep:
            ep.reset(t)
            ep.exec(f"cat > /tmp/loop.py <<'EOF'\n{LOOP}EOF")
            image = [float(ep.exec("python3 /tmp/loop.py", timeout=600).stdout) for _ in range(args.runs)]
            image_version = ep.exec("python3 -c 'import sys; print(sys.version)'").stdout.strip()
            result = ep.evaluate()
        if result.reward != 1.0:
            print(result.output[-3000:], file=sys.stderr)
            return 1
        uvx = [float(x) for x in result.files["uvx.txt"].split()]
        python3 = [float(x) for x in result.files["python3.txt"].split()]
        versions = result.files["version.txt"].decode().splitlines()
        host = {}
        for candidate in dict.fromkeys(host_builds("3.13")):
            runs = [float(subprocess.run([candidate, str(Path(tmp) / "loop.py")], capture_output=True, text=True,
                                         check=True).stdout) for _ in range(args.runs)]
            host[candidate] = med(runs)
    ref = med(image)
    rows = [("the image's python3 (agent's shell)", f"{ref:.2f} s", image_version.split()[0], "reference", True),
            ("the runner's 3.13 (uvx -p 3.13)", f"{med(uvx):.2f} s",
             f"{med(uvx) / ref:.2f}x the image's; {versions[1].split()[0] if len(versions) > 1 else '?'}",
             "≤ 1.1x the image's", med(uvx) <= 1.1 * ref),
            ("the runner's python3 (the image's version)", f"{med(python3):.2f} s",
             f"{med(python3) / ref:.2f}x the image's; {versions[0].split()[0]}", "report", True)]
    for path, value in host.items():
        rows.append((f"host build {path}", f"{value:.2f} s", f"{value / ref:.2f}x the image's", "report", True))
    return report(f"the verifier's Pythons against the image's ({args.image}, {args.runs} runs, median)", rows)


if __name__ == "__main__":
    sys.exit(main())
