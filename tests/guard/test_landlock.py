"""Landlock's grants (:mod:`sequester.guard.landlock`, pure): files carved out of a grant
keep their folders listable."""

from pathlib import Path

from sequester.guard.landlock import carve_files

P = Path


def test_carving_files_out_of_landlock_grants_keeps_their_folders_listable():
    tree = {P("/usr"): ["bin", "lib"], P("/usr/lib"): ["python3.11", "x86_64-linux-gnu"],
            P("/usr/lib/python3.11"): ["os.py", "lib-dynload"], P("/usr/lib/python3.11/lib-dynload"): ["_ctypes.so", "_bisect.so"]}
    read, listable = carve_files([P("/usr"), P("/etc")], [P("/usr/lib/python3.11/lib-dynload/_ctypes.so")],
                                 listdir=lambda p: tree[p])
    assert P("/usr/lib/python3.11/lib-dynload/_ctypes.so") not in read
    assert set(read) == {P("/etc"), P("/usr/bin"), P("/usr/lib/x86_64-linux-gnu"), P("/usr/lib/python3.11/os.py"),
                         P("/usr/lib/python3.11/lib-dynload/_bisect.so")}
    assert set(listable) == {P("/usr"), P("/usr/lib"), P("/usr/lib/python3.11"), P("/usr/lib/python3.11/lib-dynload")}
