"""Made-up host facts (:class:`sequester.sandbox.host.HostFacts`) for the pure tests of a
sandbox's view and command line."""

from pathlib import Path

from sequester.sandbox.host import DirEntry, HostFacts

P = Path


def entry(path, owner=0, is_dir=True, link=None):
    return DirEntry(P(path), owner, is_dir, link is not None, link)


TOP = (
    entry("/bin", link="usr/bin"), entry("/etc"), entry("/usr"), entry("/var"), entry("/opt"),
    entry("/home"), entry("/root"), entry("/srv"), entry("/data"), entry("/tmp"), entry("/proc"),
    entry("/.dockerenv", is_dir=False),
)


def facts(uid=1000, entries=TOP, home="/home/alice", roots=("/usr",), package="/data/alice/proj/src"):
    return HostFacts(uid=uid, gid=uid, home=P(home) if home else None, python_executable=P("/usr/bin/python3"),
                     python_roots=tuple(P(r) for r in roots), package_root=P(package), entries=entries,
                     sys_cpu=P("/sys/devices/system/cpu"))


USER_ENTRIES = TOP + (entry("/home/alice", owner=1000), entry("/home/bob", owner=1001), entry("/data/alice", owner=1000),
                      entry("/data/alice/deep", owner=1000), entry("/data/shared"), entry("/scratch", owner=1000))


def ops_of(plan, kind):
    return [op.dest for op in plan if op.kind is kind]
