"""Verifier for workspace-git-free (standard library only; exits non-zero on failure)."""
import inspect
import os
import sys
import unittest

PROJECT = "/workspace/project"
sys.dont_write_bytecode = True
sys.path.insert(0, PROJECT)

import textkit  # noqa: E402
from textkit import slugify, unique_slug  # noqa: E402


class LayoutTest(unittest.TestCase):
    def test_package_location_and_signatures(self):
        self.assertEqual(os.path.realpath(textkit.__file__), os.path.join(PROJECT, "textkit", "__init__.py"))
        self.assertEqual(os.path.realpath(inspect.getfile(slugify)), os.path.join(PROJECT, "textkit", "slug.py"))
        self.assertEqual(list(inspect.signature(slugify).parameters), ["text", "max_length", "separator"])
        self.assertEqual(list(inspect.signature(unique_slug).parameters), ["text", "existing", "max_length", "separator"])
        self.assertEqual(inspect.signature(slugify).parameters["max_length"].default, 50)
        self.assertEqual(inspect.signature(unique_slug).parameters["separator"].default, "-")


class SlugifyTest(unittest.TestCase):
    def check(self, cases):
        for args, kwargs, want in cases:
            with self.subTest(args=args, kwargs=kwargs):
                self.assertEqual(slugify(*args, **kwargs), want)

    def test_basic(self):
        self.check([
            (("Hello, World!",), {}, "hello-world"),
            (("hello",), {}, "hello"),
            (("  Many   spaces\there\n",), {}, "many-spaces-here"),
            (("--Already-slugged--",), {}, "already-slugged"),
            (("C++ & C# / 2024 edition",), {}, "c-c-2024-edition"),
            (("ÉCOLE Ümlaut Crème brûlée — n°5",), {}, "ecole-umlaut-creme-brulee-n5"),
            (("日本語",), {}, ""),
            (("!!!",), {}, ""),
            (("",), {}, ""),
        ])

    def test_apostrophes(self):
        self.check([
            (("Don't panic",), {}, "dont-panic"),
            (("Rock ’n’ roll",), {}, "rock-n-roll"),
            (("'quoted'",), {}, "quoted"),
            (("It's a 'test', isn't it?",), {}, "its-a-test-isnt-it"),
        ])

    def test_separator(self):
        self.check([
            (("(a b)",), {"separator": "_"}, "a_b"),
            (("a--b__c",), {"separator": "_"}, "a_b_c"),
            (("Version 1.2.3 -- final",), {"separator": "."}, "version.1.2.3.final"),
            ((" _x_ ",), {"separator": "_"}, "x"),
        ])

    def test_max_length(self):
        fox = "The quick brown fox jumps over the lazy dog"
        self.check([
            ((fox,), {"max_length": 20}, "the-quick-brown-fox"),
            ((fox,), {"max_length": 19}, "the-quick-brown-fox"),
            ((fox,), {"max_length": 18}, "the-quick-brown"),
            ((fox,), {"max_length": 3}, "the"),
            ((fox,), {"max_length": 2}, "th"),
            ((fox,), {"max_length": None}, "the-quick-brown-fox-jumps-over-the-lazy-dog"),
            ((fox,), {}, "the-quick-brown-fox-jumps-over-the-lazy-dog"),
            (("Supercalifragilisticexpialidocious word",), {"max_length": 10}, "supercalif"),
            (("x" * 80,), {}, "x" * 50),
            (("ab cd ef",), {"max_length": 5, "separator": "_"}, "ab_cd"),
            (("word " * 30,), {}, "-".join(["word"] * 10)),
        ])


class UniqueSlugTest(unittest.TestCase):
    def test_free(self):
        self.assertEqual(unique_slug("Hello World", set()), "hello-world")
        self.assertEqual(unique_slug("Hello World", {"hello-world-2"}), "hello-world")

    def test_numbering(self):
        self.assertEqual(unique_slug("Hello World", {"hello-world"}), "hello-world-2")
        self.assertEqual(unique_slug("Hello World", {"hello-world", "hello-world-2"}), "hello-world-3")
        taken = {"hello-world"} | {f"hello-world-{i}" for i in range(2, 12)}
        self.assertEqual(unique_slug("Hello World", taken), "hello-world-12")
        self.assertEqual(unique_slug("Hello World", ["hello-world", "hello-world-1"]), "hello-world-2")

    def test_separator(self):
        self.assertEqual(unique_slug("a b", {"a_b"}, separator="_"), "a_b_2")

    def test_max_length(self):
        text = "The quick brown fox jumps"
        self.assertEqual(unique_slug(text, {"the-quick-brown-fox"}, max_length=19), "the-quick-brown-2")
        self.assertEqual(unique_slug(text, {"the-quick-brown-fox", "the-quick-brown-2"}, max_length=19),
                         "the-quick-brown-3")
        taken = {"x" * 50} | {"x" * 48 + f"-{i}" for i in range(2, 10)}
        self.assertEqual(unique_slug("x" * 60, taken), "x" * 47 + "-10")
        self.assertEqual(unique_slug("aa bb", {"aa-bb"}, max_length=None), "aa-bb-2")


if __name__ == "__main__":
    unittest.main(verbosity=2)
