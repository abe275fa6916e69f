#!/bin/bash
cat > /app/primes.py <<'PY'
primes = []
n = 2
while len(primes) < 10:
    if all(n % p for p in primes):
        primes.append(n)
    n += 1
print("\n".join(map(str, primes)))
PY
python3 /app/primes.py > /app/primes.txt
python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' > /app/version.txt
