"""Verifier for python-csv-stats (standard library only; exits non-zero on failure)."""
import json
import os
import subprocess
import sys
import unittest

APP = "/app"
STATS = os.path.join(APP, "stats.py")
REPORT = os.path.join(APP, "report.json")
DATA = os.path.join(APP, "data.csv")
HIDDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "inventory.csv")

EXPECTED_DATA = {
    "rows": 24,
    "columns": {
        "temp_c": {"count": 24, "min": -10.8, "max": 12.6, "mean": -1.13},
        "humidity_pct": {"count": 22, "min": 44, "max": 95, "mean": 70.27},
        "wind_kmh": {"count": 24, "min": 3.5, "max": 57.5, "mean": 25.39},
        "pressure_hpa": {"count": 24, "min": 987.4, "max": 1033.1, "mean": 1008.63},
    },
}

# tests/fixtures/inventory.csv: quoted commas, doubled quotes, a multi-line field,
# whitespace around a number, negative numbers, a mixed column ("batch"), a text
# column ("comment"), an all-blank column ("legacy_code") and a header with a space.
EXPECTED_HIDDEN = {
    "rows": 10,
    "columns": {
        "qty": {"count": 10, "min": -3, "max": 250, "mean": 45.3},
        "unit_price": {"count": 10, "min": 0.125, "max": 19.99, "mean": 6.71},
        "discount": {"count": 5, "min": 0.05, "max": 0.3, "mean": 0.16},
        "weight kg": {"count": 10, "min": 0.002, "max": 3, "mean": 1.22},
    },
}


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class StatsTest(unittest.TestCase):
    maxDiff = None

    def assert_report(self, got, expected):
        self.assertIsInstance(got, dict)
        self.assertEqual(set(got), {"rows", "columns"})
        self.assertIsInstance(got["rows"], int)
        self.assertNotIsInstance(got["rows"], bool)
        self.assertEqual(got["rows"], expected["rows"])
        self.assertIsInstance(got["columns"], dict)
        self.assertEqual(sorted(got["columns"]), sorted(expected["columns"]))
        for name, exp in expected["columns"].items():
            col = got["columns"][name]
            self.assertIsInstance(col, dict, name)
            self.assertEqual(set(col), {"count", "min", "max", "mean"}, name)
            self.assertIsInstance(col["count"], int, name)
            self.assertNotIsInstance(col["count"], bool, name)
            self.assertEqual(col["count"], exp["count"], name)
            for key in ("min", "max", "mean"):
                self.assertTrue(is_number(col[key]), f"{name}.{key} is not a JSON number: {col[key]!r}")
            self.assertEqual(col["min"], exp["min"], f"{name}.min")
            self.assertEqual(col["max"], exp["max"], f"{name}.max")
            self.assertAlmostEqual(col["mean"], exp["mean"], delta=1e-9, msg=f"{name}.mean")

    def run_stats(self, path):
        self.assertTrue(os.path.isfile(STATS), f"{STATS} does not exist")
        proc = subprocess.run([sys.executable, STATS, path], capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 0, f"stats.py failed: {proc.stderr}")
        return json.loads(proc.stdout)

    def test_data_csv_unchanged(self):
        with open(DATA, encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertEqual(len(lines), 25)
        self.assertEqual(lines[0], "station,date,temp_c,humidity_pct,wind_kmh,pressure_hpa,notes")

    def test_report_json(self):
        self.assertTrue(os.path.isfile(REPORT), f"{REPORT} does not exist")
        with open(REPORT, encoding="utf-8") as f:
            self.assert_report(json.load(f), EXPECTED_DATA)

    def test_stats_on_data_csv(self):
        self.assert_report(self.run_stats(DATA), EXPECTED_DATA)

    def test_stats_on_hidden_csv(self):
        self.assert_report(self.run_stats(HIDDEN), EXPECTED_HIDDEN)


if __name__ == "__main__":
    unittest.main(verbosity=2)
