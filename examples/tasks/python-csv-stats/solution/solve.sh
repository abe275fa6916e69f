#!/bin/bash
# Oracle solution for python-csv-stats: writes /app/stats.py and /app/report.json.
set -euo pipefail

cat > /app/stats.py <<'PY'
import csv
import json
import re
import sys

NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def stats(path):
    with open(path, newline="", encoding="utf-8") as f:
        records = list(csv.reader(f))
    header, data = records[0], records[1:]
    columns = {}
    for j, name in enumerate(header):
        cells = [row[j].strip() for row in data if j < len(row)]
        cells = [c for c in cells if c]
        if not cells or not all(NUMBER.match(c) for c in cells):
            continue
        values = [float(c) for c in cells]
        columns[name] = {
            "count": len(values),
            "min": min(values),
            "max": max(values),
            "mean": round(sum(values) / len(values), 2),
        }
    return {"rows": len(data), "columns": columns}


if __name__ == "__main__":
    json.dump(stats(sys.argv[1]), sys.stdout)
    sys.stdout.write("\n")
PY

python3 /app/stats.py /app/data.csv > /app/report.json
cat /app/report.json
