"""The task is solved with the compiler its Dockerfile installed (RUN apt-get install gcc)."""

import subprocess
import zlib
from pathlib import Path

INPUT = Path("/app/input.txt")


def expected(data: bytes) -> str:
    return f"{zlib.adler32(data):08x}"


def test_checksum_file():
    assert Path("/app/checksum.txt").read_text().strip() == expected(INPUT.read_bytes())


def test_program_compiles_with_the_images_gcc(tmp_path):
    binary = tmp_path / "adler32"
    subprocess.run(["gcc", "-O2", "-o", str(binary), "/app/adler32.c"], check=True, timeout=60)
    sample = tmp_path / "sample.bin"
    sample.write_bytes(bytes(range(256)) * 300)
    out = subprocess.run([str(binary), str(sample)], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == expected(sample.read_bytes())
