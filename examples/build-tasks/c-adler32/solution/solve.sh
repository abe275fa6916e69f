#!/bin/bash
set -e
cat > /app/adler32.c <<'C'
#include <stdio.h>

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 1;
    unsigned long a = 1, b = 0;
    int c;
    while ((c = fgetc(f)) != EOF) {
        a = (a + (unsigned char)c) % 65521;
        b = (b + a) % 65521;
    }
    fclose(f);
    printf("%08lx\n", (b << 16) | a);
    return 0;
}
C
gcc -O2 -o /app/adler32 /app/adler32.c
/app/adler32 /app/input.txt > /app/checksum.txt
