"""Verifier for c-word-count (standard library only; exits non-zero on failure)."""
import os
import random
import re
import shutil
import subprocess
import tempfile
import unittest

WC = "/app/wc"
SRC = "/app/wc.c"
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

# name -> (lines, words, bytes); see tests/fixtures/.
EXPECTED = {
    "empty.txt": (0, 0, 0),
    "oneword.txt": (0, 1, 11),        # no trailing newline
    "spaces.txt": (4, 3, 28),         # leading/trailing blanks, blank lines
    "controls.txt": (2, 7, 15),       # \v \f \r and CRLF are separators
    "utf8.txt": (2, 6, 32),           # multi-byte characters and U+00A0 are word bytes
    "binary.bin": (1, 4, 21),         # NUL, 0x01, 0x7f, 0xff are word bytes
}
ORDER = ["empty.txt", "oneword.txt", "spaces.txt", "controls.txt", "utf8.txt", "binary.bin"]


def reference(data):
    return data.count(b"\n"), len(re.findall(rb"[^ \t\n\v\f\r]+", data)), len(data)


def line(counts, name=None):
    fields = [str(n) for n in counts] + ([name] if name is not None else [])
    return " ".join(fields) + "\n"


class WcTest(unittest.TestCase):
    maxDiff = None

    def run_wc(self, args, stdin=None, binary=WC):
        return subprocess.run([binary] + args, input=stdin, capture_output=True, timeout=30)

    def setUp(self):
        self.assertTrue(os.path.isfile(SRC), f"{SRC} does not exist")
        self.assertTrue(os.path.isfile(WC) and os.access(WC, os.X_OK), f"{WC} is not an executable file")
        with open(WC, "rb") as f:
            self.assertEqual(f.read(4), b"\x7fELF", f"{WC} is not an ELF binary")

    def test_each_fixture(self):
        for name in ORDER:
            path = os.path.join(FIX, name)
            r = self.run_wc([path])
            self.assertEqual(r.returncode, 0, name)
            self.assertEqual(r.stderr, b"", name)
            self.assertEqual(r.stdout.decode(), line(EXPECTED[name], path), name)

    def test_several_files_and_total(self):
        paths = [os.path.join(FIX, n) for n in ORDER]
        r = self.run_wc(paths)
        want = "".join(line(EXPECTED[n], p) for n, p in zip(ORDER, paths))
        want += line(tuple(sum(EXPECTED[n][i] for n in ORDER) for i in range(3)), "total")
        self.assertEqual(r.returncode, 0)
        self.assertEqual(r.stdout.decode(), want)

    def test_stdin(self):
        with open(os.path.join(FIX, "utf8.txt"), "rb") as f:
            r = self.run_wc([], stdin=f.read())
        self.assertEqual(r.returncode, 0)
        self.assertEqual(r.stdout.decode(), "2 6 32\n")
        r = self.run_wc([], stdin=b"")
        self.assertEqual(r.stdout.decode(), "0 0 0\n")

    def test_missing_file(self):
        tmp = tempfile.mkdtemp()
        try:
            missing = os.path.join(tmp, "no-such-file.txt")
            a, b = os.path.join(FIX, "oneword.txt"), os.path.join(FIX, "controls.txt")
            r = self.run_wc([a, missing, b])
            self.assertEqual(r.returncode, 1)
            self.assertEqual(r.stderr.decode(), f"wc: {missing}: No such file or directory\n")
            self.assertEqual(r.stdout.decode(), line((0, 1, 11), a) + line((2, 7, 15), b) + "2 8 26 total\n")
        finally:
            shutil.rmtree(tmp)

    def test_large_file(self):
        rng = random.Random(20240301)
        alphabet = b"abcXYZ09\x00\x80\xff  \t\n\r\v\f"
        data = bytes(rng.choice(alphabet) for _ in range(300_000)) + b"x" * 200_000 + b"\n" * 3
        tmp = tempfile.mkdtemp()
        try:
            path = os.path.join(tmp, "big.dat")
            with open(path, "wb") as f:
                f.write(data)
            r = self.run_wc([path])
            self.assertEqual(r.returncode, 0)
            self.assertEqual(r.stdout.decode(), line(reference(data), path))
        finally:
            shutil.rmtree(tmp)

    def test_source_builds_and_matches(self):
        cc = shutil.which("gcc") or shutil.which("cc")
        self.assertIsNotNone(cc, "no C compiler to rebuild /app/wc.c")
        tmp = tempfile.mkdtemp()
        try:
            out = os.path.join(tmp, "wc-rebuilt")
            r = subprocess.run([cc, "-O2", "-o", out, SRC], capture_output=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr.decode(errors="replace"))
            paths = [os.path.join(FIX, n) for n in ("spaces.txt", "binary.bin")]
            r = self.run_wc(paths, binary=out)
            self.assertEqual(r.stdout.decode(), line((4, 3, 28), paths[0]) + line((1, 4, 21), paths[1]) + "5 7 49 total\n")
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    unittest.main(verbosity=2)
